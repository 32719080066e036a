"""Inputs through the real `spot-pipeline` command (a subprocess with its own embedded Ray):
JSON Lines without a limit; an undecodable line and prompts that are not strings become
error rows while every other row comes out; a system prompt; a messages column; stop
strings; chat-input settings refused by `validate`."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml
from transformers import AutoTokenizer

from pipeline.job import InputConfig
from pipeline.prompts import prompt_ids
from tests.pipeline_fixtures import job_dict, make_tiny_sdar, run_cli, word_prompts, write_jsonl

SYSTEM = "You are a careful maths tutor."


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("inputs")
    make_tiny_sdar(root / "model")
    return root


def _job(root: Path, name: str, prompts: Path, **sections) -> Path:
    path = root / f"{name}.yaml"
    data = job_dict(prompts, root / "model", root / name, **sections)
    path.write_text(yaml.safe_dump(data))
    return path


def _rows(output: Path) -> list[dict]:
    return pq.read_table(output / "data").to_pylist()


def _text(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True)


def _submit(job: Path, *overrides: str, count_calls: Path | None = None) -> str:
    args = ("submit", str(job), "--progress-interval", "5", *overrides)
    result = run_cli(*args, count_calls=count_calls)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


@pytest.fixture(scope="module")
def plain(root: Path) -> tuple[Path, list[dict]]:
    """A JSON Lines input: six prompts, a line cut short, a line that is not JSON, two prompts
    that are not strings and a carried column of mixed types; with a system prompt. Submitted
    with input.limit 4, then without a limit: the second run resumes the first (counting the
    driver's calls into root/calls.json)."""
    lines = [{"id": i, "prompt": p, "topic": "sums"} for i, p in enumerate(word_prompts(6))]
    lines.insert(2, '{"id": 99, "prompt": "Ella has 3 app')  # line 3
    lines.insert(5, "not JSON at all")  # line 6
    lines += [{"id": 50, "prompt": 7}, {"id": 51, "prompt": ["a", "list"], "topic": 5}]
    prompts = write_jsonl(root / "plain.jsonl", lines)
    job = _job(root, "plain", prompts, input={"system_prompt": SYSTEM})

    checked = run_cli("validate", str(job))
    assert checked.returncode == 0, checked.stderr
    assert checked.stdout.startswith("ok: test: 10 rows in 1 file(s), 0 duplicated id(s)")
    assert "2 row(s) cannot be read: they will be error rows" in checked.stdout
    assert "0 already written, 4 to generate" in _submit(job, "--set", "input.limit=4")
    resumed = _submit(job, count_calls=root / "calls.json")
    assert "4 already written, 6 to generate" in resumed
    return prompts, _rows(root / "plain")


@pytest.mark.e2e
def test_a_submit_reads_its_input_and_hashes_its_checkpoint_once(root, plain):
    """The job is planned (its JSON Lines parsed) and its output claimed (the checkpoint
    hashed for the fingerprint) once per submit, however many stages use them."""
    calls = json.loads((root / "calls.json").read_text())
    assert calls == {"plan_input": 1, "scan_jsonl": 1, "checkpoint_identity": 1}


@pytest.mark.e2e
def test_json_lines_without_a_limit_keep_every_readable_row(root, plain):
    prompts, rows = plain
    by_id = {r["id"]: r for r in rows}
    assert len(rows) == len(by_id) == 10  # every line once, over both runs
    for i in range(6):
        assert by_id[str(i)]["error"] is None and by_id[str(i)]["completion"]
        assert by_id[str(i)]["topic"] == "sums"
    broken, not_json = by_id[f"{prompts}:3"], by_id[f"{prompts}:6"]
    assert broken["error"].startswith(f"{prompts} line 3: not valid JSON (Unterminated string")
    assert not_json["error"].startswith(f"{prompts} line 6: not valid JSON (Expecting value")
    for row in (broken, not_json):
        assert row["finish_reason"] == "error" and row["completion"] is None
    assert by_id["50"]["error"] == "prompt is not a string (int)"
    assert by_id["51"]["error"] == "prompt is not a string (list)"
    assert by_id["51"]["topic"] == "5"  # a column of mixed types is carried as text


@pytest.mark.e2e
def test_the_system_prompt_goes_before_each_prompt(root, plain):
    _, rows = plain
    tokenizer = AutoTokenizer.from_pretrained(root / "model")
    alone = InputConfig(path="unused")
    with_system = InputConfig(path="unused", system_prompt=SYSTEM)
    for row in rows:
        if row["error"] is None:
            expected = prompt_ids(tokenizer, {"prompt": row["prompt"]}, with_system)
            assert row["num_prompt_tokens"] == len(expected)
            shorter = prompt_ids(tokenizer, {"prompt": row["prompt"]}, alone)
            assert len(shorter) < len(expected)


@pytest.mark.e2e
def test_stop_strings_end_completions_before_the_first_one(root, plain):
    prompts, plain_rows = plain
    first = next(r["completion"] for r in plain_rows if r["id"] == "0")
    stops = [first[len(first) // 2 :][:3], "\N{SNOWMAN} never"]
    job = _job(root, "stopped", prompts, input={"system_prompt": SYSTEM}, decoding={"stop": stops})
    _submit(job)
    tokenizer = AutoTokenizer.from_pretrained(root / "model")
    uncut = {r["id"]: r for r in plain_rows}
    stopped, saved = 0, 0
    for row in _rows(root / "stopped"):
        before = uncut[row["id"]]
        if row["error"] is not None:
            assert row["error"] == before["error"]
            continue
        assert row["nfe"] <= before["nfe"]  # decoding stops after the block with the stop
        saved += before["nfe"] - row["nfe"]
        text, ids = before["completion"], before["completion_token_ids"]
        cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=None)
        if cut is None:
            assert row["completion"] == text and row["completion_token_ids"] == ids
            assert row["finish_reason"] == before["finish_reason"]
            continue
        stopped += 1
        assert row["finish_reason"] == "stop" and row["completion"] == text[:cut]
        kept = row["completion_token_ids"]
        assert kept == ids[: len(kept)] and row["num_generated_tokens"] == len(kept)
        assert _text(tokenizer, kept).startswith(text[:cut])  # the ids cover the text
        assert not kept or len(_text(tokenizer, kept[:-1])) < cut  # and no token more
    assert stopped >= 1 and saved > 0


@pytest.mark.e2e
def test_messages_column_with_a_system_prompt(root):
    conversations = [
        [{"role": "user", "content": "What is 2 + 3?"}],
        [
            {"role": "system", "content": "Answer in one word."},
            {"role": "user", "content": "What is 4 + 4?"},
        ],
        [
            {"role": "user", "content": "Add 1 and 2."},
            {"role": "assistant", "content": "3"},
            {"role": "user", "content": "And 3 more?"},
        ],
    ]
    lines = [{"id": f"c{i}", "chat": c} for i, c in enumerate(conversations)]
    lines[0]["prompt"] = "a column named like the prompt column"
    lines += [
        {"id": "robot", "chat": [{"role": "robot", "content": "beep"}]},
        {"id": "text", "chat": "What is 5 + 5?"},
        {"id": "no-user", "chat": [{"role": "system", "content": "Be brief."}]},
    ]
    prompts = write_jsonl(root / "chat.jsonl", lines)
    job = _job(root, "chat", prompts, input={"messages_column": "chat", "system_prompt": SYSTEM})
    _submit(job)
    rows = {r["id"]: r for r in _rows(root / "chat")}
    assert len(rows) == 6
    tokenizer = AutoTokenizer.from_pretrained(root / "model")
    for i, turns in enumerate(conversations):
        row = rows[f"c{i}"]
        assert row["error"] is None and row["completion"]
        assert row["messages"] == turns
        assert row["prompt"] == [t["content"] for t in turns if t["role"] == "user"][-1]
        if turns[0]["role"] != "system":
            turns = [{"role": "system", "content": SYSTEM}, *turns]
        text = tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=False)
        assert row["num_prompt_tokens"] == len(tokenizer(text, add_special_tokens=False).input_ids)
    assert rows["c0"]["input_prompt"] == "a column named like the prompt column"
    expected = {
        "robot": "messages[0].role is 'robot', not one of system, user, assistant",
        "text": "messages is not a list of role/content turns (str)",
        "no-user": "messages has no user turn",
    }
    for key, error in expected.items():
        assert rows[key]["error"] == error and rows[key]["finish_reason"] == "error"
        assert rows[key]["prompt"] is None


def test_chat_input_settings_are_checked_before_ray_starts(root):
    prompts = write_jsonl(root / "few.jsonl", [{"id": 1, "chat": [], "prompt": "hi"}])
    cases = [
        (
            {"messages_column": "chat", "chat_template": False},
            {},
            "input.messages_column: needs input.chat_template: true",
        ),
        (
            {"system_prompt": SYSTEM, "chat_template": False},
            {},
            "input.system_prompt: needs input.chat_template: true",
        ),
        (
            {"messages_column": "conversation"},
            {},
            "input.messages_column: no column "
            "'conversation' in the input (columns: ['id', 'chat', 'prompt'])",
        ),
        ({}, {"stop": ["", "x"]}, "decoding.stop: stop strings must not be empty"),
    ]
    for i, (inputs, decoding, message) in enumerate(cases):
        job = _job(root, f"bad{i}", prompts, input=inputs, decoding=decoding)
        for command in ("validate", "submit"):
            result = run_cli(command, str(job), timeout=120)
            assert result.returncode == 2, (command, result.stdout, result.stderr)
            assert message in result.stderr, (command, result.stderr)
