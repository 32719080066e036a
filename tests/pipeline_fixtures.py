"""Shared pieces of the pipeline tests: small prompt files, a digit tokenizer checkpoint for
the toy target, and job dictionaries."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray

from tests.toy import ToyTarget

TOY_VOCAB = {str(d): d for d in range(10)} | {"<eos>": 10, "<mask>": 11}


def make_toy_checkpoint(directory: Path) -> Path:
    """A checkpoint directory whose tokenizer maps digits to the toy target's ids 0-9."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordLevel(TOY_VOCAB, unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="<eos>", mask_token="<mask>"
    )
    directory.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(directory)
    (directory / "config.json").write_text(json.dumps({"model_type": "toy"}))
    return directory


def toy_loader(job) -> tuple[Any, ToyTarget]:
    """Model loader for jobs on the toy checkpoint: its tokenizer and the float64 toy."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(job.model.path, local_files_only=True)
    return tokenizer, ToyTarget(seed=3, absolute_block_grid=True)


def digit_prompts(n: int, seed: int = 0) -> list[str]:
    return [str(10**3 + (seed * 7919 + i * 104729) % 9000)[: 2 + i % 5] for i in range(n)]


def write_prompts(path: Path, rows: dict[str, list]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(rows), path)
    return path


def job_dict(input_path: Path, model_path: Path, output_path: Path, **sections) -> dict:
    job = {
        "name": "test",
        "input": {"path": str(input_path), "chat_template": False},
        "model": {"path": str(model_path), "dtype": "float64"},
        "decoding": {"gen_length": 16, "block_length": 4, "temperature": 0.0, "seed": 1},
        "resources": {"replicas": 1, "batch_size": 4, "num_cpus": 0.5},
        "output": {"path": str(output_path)},
    }
    for key, value in sections.items():
        job[key] = {**job.get(key, {}), **value}
    return job


@pytest.fixture(scope="module")
def local_ray():
    """One local Ray for a test module (4 logical CPUs: replicas plus read/write tasks)."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    temp_dir = tempfile.mkdtemp(prefix="spot-ray-test-")
    ray.init(num_cpus=4, include_dashboard=False, _temp_dir=temp_dir, configure_logging=False)
    yield
    ray.shutdown()
    shutil.rmtree(temp_dir, ignore_errors=True)


def read_output(path: Path) -> pa.Table:
    return pq.read_table(path / "data")


def by_key(table: pa.Table, *columns: str) -> dict[tuple, tuple]:
    """{(id, sample_index): (column values...)} — fails on a duplicated key."""
    rows = table.to_pylist()
    keyed = {(r["id"], r["sample_index"]): tuple(r[c] for c in columns) for r in rows}
    assert len(keyed) == len(rows), "duplicate (id, sample_index) in the output"
    return keyed
