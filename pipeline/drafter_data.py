"""What the drafter commands and the benchmarks read: a target with its tokenizer, the
bundled corpus's prompt sets, and prompts encoded as decode requests.

No click here: `bench/` imports this module, never a command module.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch

from pipeline.locations import Location
from spot.builtin import resolve_builtin
from spot.decode import Request
from spot.models.loading import DTYPES, load_target
from spot.noise import request_key
from spot_common.corpus import examples, read_jsonl
from spot_common.tokenizer import load_tokenizer


def load_model_and_tokenizer(path: str, dtype: str = "float32", device: str = "cpu"):
    """The tokenizer and target of `builtin:<name>`, a checkpoint directory or a hub id (read
    as a job reads model.path), the target on `device` ("auto": the GPU when there is one)."""
    local = Location.parse(path, hub_id=True).checkpoint()
    tokenizer = load_tokenizer(local)
    return tokenizer, load_target(local, dtype=DTYPES[dtype], device=resolve_device(device))


def resolve_device(device: str) -> str:
    """`auto` is the first CUDA device when torch sees one, else the CPU."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def file_prompts(path: str | Path, count: int, skip: int = 0) -> list[dict]:
    """Rows `skip` .. `skip + count` of a JSON Lines file of `{"id", "prompt"}` objects: a
    user's own prompts to evaluate or calibrate a drafter on. Too few rows is an error, so a
    curve is never measured on fewer prompts than asked for without saying so."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
                raise ValueError(f"{path}:{number}: expected an object with a string 'prompt'")
            rows.append({**row, "id": str(row.get("id", f"{Path(path).name}:{number}"))})
    if len(rows) < skip + count:
        raise ValueError(f"{path} holds {len(rows)} prompts; {skip + count} are needed")
    return rows[skip : skip + count]


def corpus_prompts(split: str, count: int, seed: int = 0) -> list[dict]:
    """Prompts of the bundled corpus: the train split (its stream of `seed`), or the shipped
    held-out file."""
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
