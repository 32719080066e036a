"""A replica's one decode loop (pipeline/decoder.py) through the engine, without Ray: calls
sharing one batch, draining, and failures that speak, on a real tiny target wrapped to fail
(tests/faulty_target.py): a row whose forward fails, every forward failing, out of memory
above batch 2. Rows that come back are always the rows a clean engine makes."""

from __future__ import annotations

import os
from pathlib import Path

import pyarrow as pa
import pytest
import torch

from pipeline.decoder import TooManyFailuresError
from pipeline.engine import Engine
from pipeline.job import parse_job
from pipeline.schema import ROW_ERROR
from pipeline.text import tokenize_rows
from tests.faulty_target import FaultyTarget
from tests.pipeline_fixtures import job_dict, make_tiny_sdar, word_prompts, write_prompts

COMPARED = ("completion_token_ids", "nfe", "steps", "finish_reason", "error")


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> dict[str, Path]:
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("decoder")
    model = make_tiny_sdar(root / "model")
    prompts = write_prompts(root / "p.parquet", {"id": ["a"], "prompt": ["x"]})
    return {"root": root, "model": model, "prompts": prompts}


def _engine(made, plan: dict | None = None, **resources) -> tuple[Engine, list[str]]:
    """An engine of the tiny target at T=0.7 (its target failing as `plan` says), and the
    lines its decode loop logs. SPOT_TEST_DEVICE=cuda puts the target on the GPU
    (scripts/gpu_check.sh)."""
    if os.environ.get("SPOT_TEST_DEVICE") == "cuda":
        resources = {**resources, "num_gpus": 1}
    job = job_dict(
        made["prompts"],
        made["model"],
        made["root"] / "out",
        decoding={"temperature": 0.7},
        resources=resources,
    )
    engine = Engine(parse_job(job))
    if plan is not None:
        engine.target = FaultyTarget(engine.target, plan)
    lines: list[str] = []
    engine.decoder.log = lines.append
    return engine, lines


def _rows(engine: Engine, n: int, first: int = 0) -> pa.Table:
    """n tokenized rows (ids r<first>...)."""
    ids = [f"r{i}" for i in range(first, first + n)]
    batch = pa.table(
        {
            "id": ids,
            "prompt": word_prompts(first + n)[first:],
            "sample_index": pa.array([0] * n, pa.int64()),
            ROW_ERROR: pa.array([None] * n, pa.string()),
        }
    )
    return tokenize_rows(engine.tokenizer, engine.job.input, batch)


def _keyed(table: pa.Table) -> dict[str, tuple]:
    return {r["id"]: tuple(r[c] for c in COMPARED) for r in table.to_pylist()}


@pytest.fixture(scope="module")
def clean(made) -> dict[str, tuple]:
    """16 rows as a clean engine makes them."""
    engine, _ = _engine(made, batch_size=4)
    return _keyed(engine.generate_rows(_rows(engine, 16)))


def _requests_per_forward(tables: list[pa.Table]) -> float:
    table = pa.concat_tables(tables)
    nfe, share = (sum(table.column(c).to_pylist()) for c in ("nfe", "forward_share"))
    return nfe / share


def test_calls_in_flight_share_one_full_batch(made, clean):
    """Two calls of six rows given to one replica at once decode in one batch that stays
    full until the last rows: more requests per forward than the two calls one after the
    other (each drains its own last batch), the same rows."""
    engine, _ = _engine(made, batch_size=4)
    first, second = _rows(engine, 6), _rows(engine, 6, first=6)
    apart = [engine.generate_rows(first), engine.generate_rows(second)]
    calls = [engine.submit_rows(first, "one"), engine.submit_rows(second, "two")]
    together = []
    for call in calls:
        call.call.done.result(timeout=300)
        together.append(call.table())
    for tables in (apart, together):
        assert {**_keyed(tables[0]), **_keyed(tables[1])} == {
            k: v for k, v in clean.items() if int(k[1:]) < 12
        }
    assert _requests_per_forward(together) > _requests_per_forward(apart) + 0.3


def test_a_drain_returns_the_finished_rows_only(made, clean):
    """After `drain`, waiting rows are let go and active ones finish: a call returns the
    rows that finished (each as a clean engine makes it), a call submitted later returns at
    once without its rows; `abandon` lets the active ones go too."""
    engine, _ = _engine(made, batch_size=2)
    rows = engine.submit_rows(_rows(engine, 8), "drained")
    record = rows.call.on_outcome

    def drain_at_the_first(position, outcome):  # in the decode thread: no race
        record(position, outcome)
        engine.decoder.drain()

    rows.call.on_outcome = drain_at_the_first
    rows.call.done.result(timeout=300)
    kept = _keyed(rows.table())
    assert len(kept) == 2 and kept == {k: clean[k] for k in kept}  # the first two (19 NFE each)
    late = engine.submit_rows(_rows(engine, 3, first=8), "late")
    assert late.call.done.result(timeout=10) is None and late.table().num_rows == 0

    engine, _ = _engine(made, batch_size=2)
    rows = engine.submit_rows(_rows(engine, 4), "abandoned")
    engine.decoder.abandon()
    rows.call.done.result(timeout=10)
    assert rows.table().num_rows == 0 and engine.decoder.unfinished() == 0


@pytest.mark.parametrize("batch_size", [1, 3, 8])
def test_a_row_whose_forward_fails_becomes_an_error_row_alone(made, clean, batch_size):
    """A row whose every forward fails (whatever shares it) is an error row of kind
    "generation"; the batch's other rows are decoded again in halves and come back as a
    clean engine makes them. Each failed batch is logged with its traceback and counted."""
    probe, _ = _engine(made)
    prompts = [probe.encode(p) for p in word_prompts(12)]
    poison, victim = next(
        (token, i)
        for i, ids in enumerate(prompts)
        for token in ids
        if sum(token in other for other in prompts) == 1
    )
    engine, lines = _engine(made, {"poison": poison}, batch_size=batch_size)
    table = engine.generate_rows(_rows(engine, 12))
    rows = {r["id"]: r for r in table.to_pylist()}
    bad = rows.pop(f"r{victim}")
    assert bad["error"] == (
        f"generation failed: RuntimeError: injected failure of a forward holding token {poison}"
    )
    assert bad["error_kind"] == "generation" and bad["finish_reason"] == "error"
    assert {k: tuple(r[c] for c in COMPARED) for k, r in rows.items()} == {
        k: clean[k] for k in rows
    }
    assert all(r["error_kind"] is None for r in rows.values())
    failures = sum(engine.decoder.failures.values())
    assert failures >= 2 and len(lines) == failures  # the batch, then the row alone
    assert "Traceback (most recent call last)" in lines[0] and "injected failure" in lines[0]


def test_out_of_memory_halves_the_batch_and_says_so(made, clean):
    """Out of memory above 2 requests per forward at batch 8: the replica halves its batch
    (8 -> 4 -> 2), logs each halving, and every row comes back as a clean engine makes it."""
    engine, lines = _engine(made, {"oom_above": 2}, batch_size=8)
    table = engine.generate_rows(_rows(engine, 16))
    assert _keyed(table) == clean
    assert engine.decoder.max_active == 2
    halvings = [line for line in lines if line.startswith("out of memory")]
    assert halvings == [
        "out of memory decoding 8 requests at once: this replica now decodes at most 4 at "
        "once (resources.batch_size was 8)",
        "out of memory decoding 4 requests at once: this replica now decodes at most 2 at "
        "once (resources.batch_size was 4)",
    ]
    assert sum(engine.decoder.failures.values()) == 2
    assert 1.5 < _requests_per_forward([table]) <= 2


def test_every_forward_failing_stops_the_job_naming_the_error(made):
    """Every forward fails: with max_error_rate 1 every row is an error row of kind
    "generation" (one traceback per kind of failure is enough: later ones take a line); at
    the default 0.5, the call fails once 8 rows are rated, naming the most common error and
    example rows."""
    engine, lines = _engine(made, {"every": True}, batch_size=4, max_error_rate=1.0)
    table = engine.generate_rows(_rows(engine, 12))
    assert table.column("error_kind").to_pylist() == ["generation"] * 12
    assert set(table.column("error").to_pylist()) == {
        "generation failed: RuntimeError: injected failure of every forward"
    }
    tracebacks = [line for line in lines if "Traceback" in line]
    assert len(tracebacks) == 3 and len(lines) == sum(engine.decoder.failures.values()) > 12

    engine, lines = _engine(made, {"every": True}, batch_size=4)
    with pytest.raises(TooManyFailuresError) as stopped:
        engine.generate_rows(_rows(engine, 12))
    assert str(stopped.value).startswith(
        "8 of the last 8 rows failed in generation, more than resources.max_error_rate 0.5; "
        "most common (8 rows, e.g. r"
    )
    assert str(stopped.value).endswith("): RuntimeError: injected failure of every forward")
    assert lines[-1] == f"stopping the job: {stopped.value}"
    with pytest.raises(TooManyFailuresError):  # the replica takes no more rows
        engine.generate_rows(_rows(engine, 2, first=12))
