"""What the drafter commands and the benchmarks read: a target with its tokenizer, the
bundled corpus's prompt sets, and prompts encoded as decode requests.

No click here: `bench/` imports this module, never a command module.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from pipeline.tokenizer import load_tokenizer
from spot.builtin import resolve_builtin
from spot.decode import Request
from spot.models.loading import DTYPES, load_target
from spot.noise import request_key


def load_model_and_tokenizer(path: str, dtype: str = "float32"):
    """The tokenizer and target of a checkpoint directory or `builtin:<name>`."""
    local = resolve_builtin(path) if path.startswith("builtin:") else Path(path)
    tokenizer = load_tokenizer(local)
    return tokenizer, load_target(local, dtype=DTYPES[dtype])


def corpus_prompts(split: str, count: int, seed: int = 0) -> list[dict]:
    """Prompts of the bundled corpus: the train split (its stream of `seed`), or the shipped
    held-out file."""
    from spot_factory.corpus import examples, read_jsonl

    if split == "heldout":
        return read_jsonl(resolve_builtin("prompts/heldout.jsonl"))[:count]
    stream = examples(seed, "train")
    return [{"id": f"train-{i}", "prompt": next(stream).prompt} for i in range(count)]


def encode(tokenizer, prompts: Sequence[dict]) -> list[Request]:
    """Decode requests of `{"id", "prompt"}` rows: the prompt as one chat user turn, the
    noise key from the id."""
    out = []
    for p in prompts:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": p["prompt"]}], add_generation_prompt=True, tokenize=False
        )
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        out.append(Request(torch.tensor(ids), request_key(p["id"])))
    return out
