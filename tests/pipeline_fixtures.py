"""Shared pieces of the pipeline tests: a tiny random SDAR checkpoint in the original format
with the bundled tokenizer, small prompt files, job dictionaries, one local Ray per module."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray
import torch

from spot.builtin import resolve_builtin
from spot.models.loading import save_checkpoint
from spot.models.registry import family_for
from spot.models.transformer import TransformerConfig

MAX_POSITIONS = 256


def make_tiny_sdar(directory: Path, seed: int = 0) -> Path:
    """A random 2-layer SDAR-family checkpoint (original key names, float64) beside a copy of
    the bundled tokenizer. Weights are scaled so that predictions are peaked; the mask
    token's output row is the mean of the others, so it is never the argmax."""
    from transformers import AutoTokenizer

    tokenizer_dir = resolve_builtin("tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    family = family_for("sdar")
    config = TransformerConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        qk_norm=True,
        max_position_embeddings=MAX_POSITIONS,
    )
    model = family.build(config).to(torch.float64)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=generator, dtype=p.dtype))
            elif p.dim() == 2:
                fan_in = 1 if "embed" in name else p.shape[1]
                p.copy_(torch.randn(p.shape, generator=generator, dtype=p.dtype) * 2 / fan_in**0.5)
        head = model.lm_head.weight
        others = torch.ones(config.vocab_size, dtype=torch.bool)
        others[tokenizer.mask_token_id] = False
        head[tokenizer.mask_token_id] = head[others].mean(0)
    eos_ids = (tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>"))
    save_checkpoint(directory, family, model.eval(), tokenizer.mask_token_id, eos_ids)
    for file in tokenizer_dir.iterdir():
        shutil.copy(file, directory / file.name)
    return directory


def word_prompts(n: int) -> list[str]:
    """n different short maths prompts."""
    return [f"Ella has {3 + i} apples and buys {2 * i + 1} more. How many now?" for i in range(n)]


def write_prompts(path: Path, rows: dict[str, list]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(rows), path)
    return path


def job_dict(input_path: Path, model_path: Path, output_path: Path, **sections) -> dict:
    job = {
        "name": "test",
        "input": {"path": str(input_path), "chat_template": True},
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


def write_jsonl(path: Path, lines: list) -> Path:
    """One line per item: a dict as JSON, a string as it is (to write broken lines)."""
    import json

    path.parent.mkdir(parents=True, exist_ok=True)
    text = [line if isinstance(line, str) else json.dumps(line) for line in lines]
    path.write_text("\n".join(text) + "\n")
    return path


# run_cli(count_calls=...): the CLI, counting every call of these functions in the driver's
# main thread (a profile hook sees them however they were imported), written as JSON. Each
# call is appended to a log as it happens, so the calls of the driver's forked session
# (pipeline.session), which leaves without running this process's `finally`, count too.
COUNTED_CALLS = """
import collections, json, sys
from pipeline import fingerprint, inputs
from pipeline.cli import main
watched = {f.__code__: f.__name__ for f in (%s)}
log = sys.argv[1] + ".calls"
open(log, "w").close()
def profile(frame, event, arg):
    if event == "call" and frame.f_code in watched:
        with open(log, "a") as calls:
            calls.write(watched[frame.f_code] + "\\n")
sys.setprofile(profile)
try:
    main(sys.argv[2:])
finally:
    sys.setprofile(None)
    with open(log) as calls, open(sys.argv[1], "w") as out:
        json.dump(collections.Counter(calls.read().split()), out)
"""
WATCHED = ("inputs.plan_input", "inputs.scan_jsonl", "fingerprint.checkpoint_identity")


def run_cli(
    *args: str, env: dict | None = None, timeout: float = 600, count_calls: Path | None = None
):
    """`spot-pipeline ARGS` in a subprocess from the checkout (its own embedded Ray); with
    `count_calls`, that file receives how often the driver called each of WATCHED."""
    import subprocess
    import sys

    if count_calls is None:
        command = ["-m", "pipeline.cli", *args]
    else:
        command = ["-c", COUNTED_CALLS % ", ".join(WATCHED), str(count_calls), *args]
    return subprocess.run(
        [sys.executable, *command],
        cwd=REPO,
        env=cli_environment(env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


REPO = Path(__file__).resolve().parents[1]


def cli_environment(env: dict | None = None) -> dict:
    """The environment `spot-pipeline` runs in from the checkout (no Ray cluster named)."""
    environment = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    environment.pop("RAY_ADDRESS", None)
    return environment


def start_cli(*args: str):
    """`spot-pipeline ARGS` started in a subprocess (stdout and stderr piped), not waited
    for."""
    import subprocess
    import sys

    return subprocess.Popen(
        [sys.executable, "-m", "pipeline.cli", *args],
        cwd=REPO,
        env=cli_environment(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def output_rows(
    ids: list,
    prompts: list[str | None],
    *,
    samples: int = 1,
    tokens: int = 5,
    error: str | None = None,
    error_kind: str | None = None,
) -> pa.Table:
    """Rows as a run writes them (the columns resume, retries and totals read), made here
    without a model: one per (id, sample), each with `tokens` generated tokens unless it
    has an `error` (of `error_kind`)."""
    from pipeline.identity import row_digests

    n = len(ids) * samples
    ok = error is None
    repeat = [i for i in range(len(ids)) for _ in range(samples)]
    digests = row_digests(pa.array(ids), pa.array(prompts, pa.string())).take(repeat)
    return pa.table(
        {
            "id": pa.array(ids).take(repeat),
            "prompt": pa.array(prompts, pa.string()).take(repeat),
            "completion": pa.array(["done"] * n if ok else [None] * n, pa.string()),
            "num_prompt_tokens": pa.array([3] * n, pa.int64()),
            "num_generated_tokens": pa.array([tokens] * n if ok else [None] * n, pa.int64()),
            "nfe": pa.array([2] * n if ok else [None] * n, pa.int64()),
            "steps": pa.array([2] * n if ok else [None] * n, pa.int64()),
            "accepted_steps_per_forward": pa.array([1.0] * n if ok else [None] * n),
            "forward_share": pa.array([0.5] * n if ok else [None] * n),
            "finish_reason": pa.array(["eos" if ok else "error"] * n),
            "error": pa.array([error] * n, pa.string()),
            "error_kind": pa.array([error_kind] * n, pa.string()),
            "sample_index": pa.array([s for _ in ids for s in range(samples)], pa.int64()),
            "input_digest": digests,
        }
    )
