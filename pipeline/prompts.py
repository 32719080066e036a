"""Text on either side of the model, as pure functions of (tokenizer, row, input config):
a row's prompt token ids (a plain prompt or a conversation, an optional system prompt, the
chat template) and a completion cut at its first stop string.

They read nothing else, so a tokenization stage of its own (as Ray Data LLM runs a chat-template
and a tokenize stage before the engine) can call them as the engine does. A row is a mapping in
the engine's column names: `prompt` (the input's prompt column) or `messages` (its messages
column, a list of {role, content} as OpenAI and Ray Data LLM take it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pipeline.job import InputConfig
from pipeline.schema import MESSAGES, PROMPT

ROLES = ("system", "user", "assistant")


class PromptError(ValueError):
    """A row whose prompt cannot be built; the message becomes the row's `error`."""


def messages_problem(messages: Any) -> str | None:
    """Why `messages` is not a conversation, None when it is: a non-empty list of mappings
    with a role (system, user or assistant) and a string content, one user turn at least."""
    if messages is None:
        return "messages is null"
    if not isinstance(messages, list | tuple):
        return f"messages is not a list of role/content turns ({type(messages).__name__})"
    if not messages:
        return "messages is empty"
    for i, turn in enumerate(messages):
        if not isinstance(turn, Mapping):
            return f"messages[{i}] is not a mapping of role and content ({type(turn).__name__})"
        if turn.get("role") not in ROLES:
            return f"messages[{i}].role is {turn.get('role')!r}, not one of {', '.join(ROLES)}"
        if not isinstance(turn.get("content"), str):
            kind = type(turn.get("content")).__name__
            return f"messages[{i}].content is not a string ({kind})"
    if not any(turn["role"] == "user" for turn in messages):
        return "messages has no user turn"
    return None


def prompt_problem(prompt: Any) -> str | None:
    """Why a plain prompt cannot be used, None when it can."""
    if prompt is None:
        return "prompt is null"
    if not isinstance(prompt, str):
        return f"prompt is not a string ({type(prompt).__name__})"
    if not prompt.strip():
        return "prompt is empty"
    return None


def conversation(row: Mapping[str, Any], config: InputConfig) -> list[dict[str, str]]:
    """The row's chat turns: its messages, or its prompt as one user turn; the job's system
    prompt goes first unless the row brings a system turn of its own. Raises PromptError."""
    if config.messages_column is not None:
        messages = row.get(MESSAGES)
        problem = messages_problem(messages)
        if problem:
            raise PromptError(problem)
        turns = [{"role": t["role"], "content": t["content"]} for t in messages]
    else:
        problem = prompt_problem(row.get(PROMPT))
        if problem:
            raise PromptError(problem)
        turns = [{"role": "user", "content": row[PROMPT]}]
    if config.system_prompt is not None and turns[0]["role"] != "system":
        turns.insert(0, {"role": "system", "content": config.system_prompt})
    return turns


def prompt_text(row: Mapping[str, Any], config: InputConfig) -> str | None:
    """What the output's `prompt` column holds: the plain prompt, or for a conversation the
    content of its last user turn (the whole conversation stays in the `messages` column).
    None when the row has neither."""
    if config.messages_column is None:
        prompt = row.get(PROMPT)
        return prompt if isinstance(prompt, str) else None
    if messages_problem(row.get(MESSAGES)) is not None:
        return None
    return [t["content"] for t in row[MESSAGES] if t["role"] == "user"][-1]


def prompt_ids(tokenizer: Any, row: Mapping[str, Any], config: InputConfig) -> list[int]:
    """The row's prompt token ids: through the chat template (input.chat_template, always for
    messages), else the raw prompt text. Raises PromptError with the row's error message."""
    if config.chat_template:
        turns = conversation(row, config)
    else:
        problem = prompt_problem(row.get(PROMPT))
        if problem:
            raise PromptError(problem)
    try:
        if not config.chat_template:
            return tokenizer(row[PROMPT])["input_ids"]
        text = tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=False)
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    except Exception as error:  # a tokenizer or template failure is this row's problem only
        raise PromptError(f"cannot tokenize prompt: {type(error).__name__}: {error}") from error


def find_stop(text: str, stops: Sequence[str]) -> int | None:
    """Where the first stop string begins in `text` (the earliest occurrence of any of them),
    None when none occurs. Safe on a partial completion: only complete occurrences count, and
    text added later cannot move an occurrence already found."""
    found = [i for i in (text.find(stop) for stop in stops if stop) if i >= 0]
    return min(found) if found else None


def cut_at_stop(
    tokenizer: Any, ids: Sequence[int], stops: Sequence[str]
) -> tuple[list[int], str, bool]:
    """(ids, text, stopped) of a completion cut at its first stop string. The text ends just
    before the stop string; the ids are the shortest prefix whose decoded text covers that
    text, so a token that holds the start of the stop string stays. Without a stop string in
    the text, the ids and their decoded text are returned whole."""
    ids = list(ids)
    text = tokenizer.decode(ids, skip_special_tokens=True)
    end = find_stop(text, stops)
    if end is None:
        return ids, text, False
    keep = 0
    while keep < len(ids) and len(tokenizer.decode(ids[:keep], skip_special_tokens=True)) < end:
        keep += 1
    return ids[:keep], text[:end], True
