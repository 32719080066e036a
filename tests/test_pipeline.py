"""End to end on a real local Ray: Parquet prompts in, corpus and per-sample stats out.

The output contract (columns, carried columns, one row per input row and sample, readers),
bad rows as error rows, the summary, reproducibility across replicas and batch sizes, and
faults: a replica that dies, a job interrupted and submitted again, part files that appear
whole or not at all. One Ray for the module; runs are shared between tests where a run can
show two things (six Ray runs in all).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.dataset as pds
import pyarrow.parquet as pq
import pytest
import ray

from pipeline.identity import InputChanged
from pipeline.job import Job, parse_job
from pipeline.output import OutputDir, row_keys, write_atomically, write_part
from pipeline.processor import build_processor
from pipeline.runner import Run, count_pending, run_job
from pipeline.schema import GENERATED_FIELDS
from pipeline.stages import MAX_BLOCKS_PER_RUN, GenerationActor, rows_per_block
from pipeline.summary import Totals, histogram_percentile
from tests.pipeline_fixtures import (
    by_key,
    job_dict,
    local_ray,  # noqa: F401  (module fixture)
    make_tiny_sdar,
    read_output,
    word_prompts,
    write_prompts,
)

GOOD = 14
BAD = 7
SAMPLES = 2
COMPARED = ("completion_token_ids", "nfe", "steps", "error")
ROW_IDS = [f"r{i}" for i in range(GOOD)]


class DiesOnceActor(GenerationActor):
    """Kills its own process on its first batch of the job (once: a marker file remembers)."""

    async def __call__(self, batch: pa.Table) -> pa.Table:
        marker = Path(self.engine.job.output.path.text + ".died")
        if not marker.exists():
            marker.write_text(str(os.getpid()))
            os._exit(1)
        return await super().__call__(batch)


class InterruptedActor(GenerationActor):
    """Fails the job (an exception Ray does not retry) on its second call, once the first
    block (a call's rows: 32 of the 42 here) is on disk: the job dies half written, whatever
    order the replica takes its blocks in."""

    calls = 0

    async def __call__(self, batch: pa.Table) -> pa.Table:
        self.calls += 1
        if self.calls == 2:
            output = OutputDir(self.engine.job.output.path.text)
            deadline = time.monotonic() + 120
            while not output.part_files() and time.monotonic() < deadline:
                await asyncio.sleep(0.2)
            raise RuntimeError("interrupted")
        return await super().__call__(batch)


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pipeline")
    ids = ROW_IDS + ["null", "empty", "blank", "long", "dup", "dup", None]
    prompts = word_prompts(GOOD) + [None, "", "   ", "seven " * 400, "a", "b", "c"]
    prompts_file = write_prompts(
        root / "in" / "prompts.parquet",
        {"id": ids, "prompt": prompts, "source": [f"s{i}" for i in range(len(ids))]},
    )
    return {"root": root, "model": make_tiny_sdar(root / "model"), "prompts": prompts_file}


def _job(
    setup,
    name: str,
    temperature: float,
    replicas: int,
    batch_size: int,
    prompts: Path | None = None,
) -> Job:
    return parse_job(
        job_dict(
            prompts or setup["prompts"],
            setup["model"],
            setup["root"] / name,
            decoding={"temperature": temperature, "samples_per_prompt": samples(temperature)},
            resources={"replicas": replicas, "batch_size": batch_size},
            cost={"usd_per_replica_hour": 3.6},
        )
    )


def samples(temperature: float) -> int:
    """Samples per prompt: SAMPLES, one at T=0 (where samples would be the same)."""
    return SAMPLES if temperature else 1


def _unique(table: pa.Table) -> pa.Table:
    """The output without the rows of the duplicated input id (their keys repeat)."""
    return table.filter(pds.field("id") != "dup")


@pytest.fixture(scope="module")
def sampled_one_replica(local_ray, setup):  # noqa: F811
    """T=0.8, one replica, batches of 8."""
    job = _job(setup, "t08-r1-b8", 0.8, replicas=1, batch_size=8)
    return Path(job.output.path.text), run_job(Run.prepare(job), echo=lambda line: None)


@pytest.fixture(scope="module")
def greedy_with_a_death(local_ray, setup):  # noqa: F811
    """T=0, one replica, batches of 4 (two blocks of its one sample a row), whose replica
    kills itself on its first batch; a reader polls the output folder meanwhile. (job,
    summary, rows per part seen, failures)"""
    job = _job(setup, "t0-r1-b4", 0.0, replicas=1, batch_size=4)
    data = Path(job.output.path.text) / "data"
    seen: dict[str, int] = {}
    failures: list[str] = []
    stop = threading.Event()

    def reader() -> None:
        while not stop.is_set():
            for path in data.glob("*.parquet") if data.exists() else []:
                try:
                    seen[path.name] = pq.read_table(path).num_rows
                except Exception as error:
                    failures.append(f"{path.name}: {error}")
            time.sleep(0.01)

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        summary = run_job(Run.prepare(job), actor_class=DiesOnceActor, echo=lambda line: None)
    finally:
        stop.set()
        thread.join()
    return job, summary, seen, failures


def test_output_rows_columns_and_errors(sampled_one_replica):
    out, summary = sampled_one_replica
    table = read_output(out)
    names = table.column_names
    assert names[:2] == ["id", "prompt"]
    assert {f.name for f in GENERATED_FIELDS} | {"sample_index", "source"} <= set(names)
    rows = table.to_pylist()
    assert len(rows) == (GOOD + 7) * 2  # one row per input row and sample, bad rows included
    keys = {(r["id"], r["sample_index"]) for r in rows if r["id"] != "dup"}
    assert len(keys) == len(rows) - 4  # every key once; the two "dup" rows both come back

    good = [r for r in rows if r["error"] is None]
    assert {r["id"] for r in good} == {f"r{i}" for i in range(GOOD)}
    for r in good:
        assert r["completion_token_ids"] and r["num_generated_tokens"] == len(
            r["completion_token_ids"]
        )
        assert isinstance(r["completion"], str)
        assert r["nfe"] >= 1 and r["steps"] >= r["nfe"]
        assert r["accepted_steps_per_forward"] == pytest.approx(r["steps"] / r["nfe"])
        assert r["finish_reason"] in ("eos", "length") and r["seed"] == 1
        assert r["model"] == str(out.parent / "model") and r["drafter"] == "none"
        assert r["source"] == f"s{int(r['id'][1:])}"  # carried through unchanged
    a, b = (
        {r["sample_index"]: r["completion_token_ids"] for r in good if r["id"] == "r0"}[s]
        for s in (0, 1)
    )
    assert a != b  # each sample has its own noise key

    errors = {(r["id"], r["error"].split(":")[0]) for r in rows if r["error"] is not None}
    assert errors == {
        ("null", "prompt is null"),
        ("empty", "prompt is empty"),
        ("blank", "prompt is empty"),
        ("long", "prompt too long"),
        ("dup", "duplicate id"),
        (None, "id is null"),
    }
    for r in rows:
        if r["error"] is not None:
            assert r["completion"] is None and r["completion_token_ids"] is None
            assert r["finish_reason"] == "error"

    totals = summary["totals"]
    assert totals["rows"] == len(rows) and totals["errors"] == 14
    assert totals["generated_tokens"] == sum(r["num_generated_tokens"] for r in good)
    assert totals["steps_per_nfe"] == pytest.approx(
        sum(r["steps"] for r in good) / sum(r["nfe"] for r in good)
    )
    assert 1 < totals["requests_per_forward"] <= 8  # batches of 8, kept full as rows finish
    assert totals["requests_per_forward"] == pytest.approx(
        sum(r["nfe"] for r in good) / sum(r["forward_share"] for r in good)
    )
    assert summary["replica_hours"] == pytest.approx(summary["wall_seconds"] / 3600)
    assert summary["cost_usd"] == pytest.approx(summary["replica_hours"] * 3.6)
    assert summary["usd_per_million_tokens"] == pytest.approx(
        summary["cost_usd"] / totals["generated_tokens"] * 1e6
    )
    assert summary["versions"]["ray"] and summary["job"]["name"] == "test"
    assert json.loads((out / "summary.json").read_text()) == summary


def test_output_is_readable_by_pyarrow_pandas_and_datasets(sampled_one_replica, tmp_path):
    import datasets

    out, summary = sampled_one_replica
    rows = summary["totals"]["rows"]
    assert pds.dataset(out / "data", format="parquet").count_rows() == rows
    frame = pd.read_parquet(out / "data")
    assert len(frame) == rows and frame["completion_token_ids"].notna().sum() == GOOD * 2
    loaded = datasets.load_dataset(
        "parquet", data_dir=str(out / "data"), split="train", cache_dir=str(tmp_path)
    )
    assert loaded.num_rows == rows and "completion" in loaded.column_names


@pytest.mark.parametrize("temperature", [pytest.param(0.0, marks=pytest.mark.e2e), 0.8])
def test_same_completions_whatever_replicas_and_batch_size(request, setup, temperature):
    if temperature == 0.8:
        one, _ = request.getfixturevalue("sampled_one_replica")
    else:
        job, _, _, _ = request.getfixturevalue("greedy_with_a_death")
        one = Path(job.output.path.text)
    two = _job(setup, f"t{temperature}-r2-b3", temperature, replicas=2, batch_size=3)
    run_job(Run.prepare(two), echo=lambda line: None)
    a = by_key(_unique(read_output(one)), *COMPARED)
    b = by_key(_unique(read_output(Path(two.output.path.text))), *COMPARED)
    assert a == b
    assert len([v for v in a.values() if v[0] is not None]) == GOOD * samples(temperature)


def test_the_processor_inside_a_users_own_pipeline(setup, sampled_one_replica, tmp_path):
    """Generation as one step of a Ray Data pipeline of the user's own: their rows under
    their own column names, their map, the processor, their map, their write. The rows it
    gives are the CLI run's (whatever the batch size)."""
    job = _job(setup, "unused", 0.8, replicas=1, batch_size=3)
    processor = build_processor(job)
    numbered = [{"n": i, "question": q} for i, q in enumerate(word_prompts(4))]
    rows = ray.data.from_items(numbered).map(
        lambda row: {"id": f"r{row['n']}", "prompt": row["question"]}
    )
    generated = processor(rows).map(
        lambda row: {
            "id": row["id"],
            "sample_index": row["sample_index"],
            "completion_token_ids": [int(t) for t in row["completion_token_ids"]],
            "nfe": row["nfe"],
            "steps": row["steps"],
            "error": row["error"],
            "words": len(row["completion"].split()),
        }
    )
    generated.write_parquet(str(tmp_path / "mine"))

    mine = pq.read_table(tmp_path / "mine")
    reference, _ = sampled_one_replica
    expected = by_key(_unique(read_output(reference)), *COMPARED)
    assert by_key(mine, *COMPARED) == {k: v for k, v in expected.items() if k[0] in ROW_IDS[:4]}
    assert mine.num_rows == 4 * SAMPLES and min(mine.column("words").to_pylist()) >= 1


@pytest.mark.e2e
def test_a_replica_that_dies_is_restarted(greedy_with_a_death):
    job, summary, _, _ = greedy_with_a_death
    assert Path(job.output.path.text + ".died").exists()  # it did die
    table = read_output(Path(job.output.path.text))
    by_key(_unique(table))  # every key once
    assert table.num_rows == (GOOD + BAD) * samples(0.0) == summary["totals"]["rows"]


@pytest.mark.e2e
def test_part_files_appear_whole(greedy_with_a_death):
    """A reader polling the output folder during the run read every part it saw in full."""
    _, summary, seen, failures = greedy_with_a_death
    assert failures == []
    assert sum(seen.values()) == summary["totals"]["rows"] and len(seen) >= 2


@pytest.mark.e2e
def test_an_interrupted_job_resumes_without_duplicates(setup, sampled_one_replica):
    """The job of `sampled_one_replica`, interrupted half way, then submitted again: every
    row exactly once, and the same completions as the run that was never interrupted."""
    job = _job(setup, "resume", 0.8, replicas=1, batch_size=8)
    out = Path(job.output.path.text)
    with pytest.raises(Exception, match="interrupted"):
        run_job(Run.prepare(job), actor_class=InterruptedActor, echo=lambda line: None)
    first = read_output(out)
    assert 0 < first.num_rows < (GOOD + BAD) * SAMPLES
    kept = {p: os.path.getmtime(p) for p in OutputDir(str(out)).part_files()}
    stale = out / "data" / ".part-left-by-a-killed-writer.parquet.partial"
    stale.write_bytes(b"PAR1 half a file")

    lines: list[str] = []
    summary = run_job(Run.prepare(job), echo=lines.append)
    assert f"{first.num_rows} already written" in lines[0]
    assert not stale.exists()
    assert all(os.path.getmtime(p) == t for p, t in kept.items())  # old parts untouched
    final = read_output(out)
    counts = Counter(zip(final.column("id").to_pylist(), final.column("sample_index").to_pylist()))
    assert {k: n for k, n in counts.items() if n != 1} == {("dup", s): 2 for s in range(SAMPLES)}
    assert final.num_rows == (GOOD + BAD) * SAMPLES == summary["totals"]["rows"]
    assert summary["runs"][-1]["rows_written"] == final.num_rows - first.num_rows
    reference, _ = sampled_one_replica
    assert by_key(_unique(final), *COMPARED) == by_key(_unique(read_output(reference)), *COMPARED)

    # nothing left: no Ray, nothing written
    again = run_job(Run.prepare(job), echo=lambda line: None)
    assert again["runs"][-1]["rows_written"] == 0 and read_output(out).num_rows == final.num_rows
    assert [r["status"] for r in again["runs"]] == ["failed", "succeeded", "succeeded"]


def test_a_write_that_dies_leaves_no_visible_file(tmp_path):
    output = OutputDir(str(tmp_path))
    table = pa.table({"id": ["a", "b"], "sample_index": [0, 0], "x": [1, 2]})

    def dies_half_way(stream) -> None:
        stream.write(b"PAR1" + b"\0" * 100)
        raise OSError("killed")

    with pytest.raises(OSError, match="killed"):
        write_atomically(output.filesystem, f"{output.data}/part-x.parquet", dies_half_way)
    assert output.part_files() == []
    assert output.remove_partial_files() == 0  # the failed writer removed its temporary
    killed = Path(output.data) / ".part-y.parquet.partial"  # a writer that was SIGKILLed
    killed.write_bytes(b"PAR1" + b"\0" * 100)
    assert output.part_files() == [] and output.remove_partial_files() == 1

    assert write_part(output, [table]) == 2
    assert write_part(output, [table.slice(1), table.slice(0, 1)]) == 2  # a retried write
    [part] = output.part_files()  # ... replaces its own file
    assert pq.read_table(part).num_rows == 2


def _make_unreadable(part: str, columns: tuple[str, ...]) -> None:
    """Overwrite the column chunks of `columns` with garbage (the footer stays valid)."""
    metadata = pq.ParquetFile(part).metadata
    with open(part, "r+b") as file:
        for group in range(metadata.num_row_groups):
            for index in range(metadata.num_columns):
                chunk = metadata.row_group(group).column(index)
                if chunk.path_in_schema.split(".")[0] in columns:
                    file.seek(chunk.dictionary_page_offset or chunk.data_page_offset)
                    file.write(b"\xff" * chunk.total_compressed_size)


def test_resume_and_summary_never_read_prompts_completions_or_token_ids(setup, sampled_one_replica):
    """The output of `sampled_one_replica` with its prompt, completion and token-id columns
    made unreadable: submitting its job again finds nothing to do and sums the same totals,
    and a job with two more input rows generates just those and counts everything."""
    reference, first = sampled_one_replica
    job = _job(setup, "unreadable", 0.8, replicas=1, batch_size=8)
    out = Path(job.output.path.text)
    shutil.copytree(reference / "data", out / "data")
    text = ("prompt", "completion", "completion_token_ids")
    for part in OutputDir(str(out)).part_files():
        _make_unreadable(part, text)
    with pytest.raises(OSError):
        pq.read_table(out / "data", columns=["completion"])

    lines: list[str] = []
    again = run_job(Run.prepare(job), echo=lines.append)
    assert f"{first['totals']['rows']} already written, 0 to generate" in lines[0]
    assert again["totals"] == first["totals"]

    source = pq.read_table(setup["prompts"])
    more = pa.table(
        {"id": ["n0", "n1"], "prompt": word_prompts(GOOD + 2)[GOOD:], "source": ["n0", "n1"]}
    )
    bigger = setup["root"] / "more-prompts.parquet"
    pq.write_table(pa.concat_tables([source, more.cast(source.schema)]), bigger)
    grown_job = _job(setup, "unreadable", 0.8, 1, 8, prompts=bigger)
    with pytest.raises(InputChanged, match="ids not generated yet: 'n0', 'n1'"):
        Run.prepare(grown_job)  # another input that grew: asked for with extend only
    grown = run_job(Run.prepare(grown_job, extend=True), echo=lambda line: None)
    new_rows = 2 * SAMPLES
    assert grown["runs"][-1]["rows_written"] == new_rows
    assert grown["totals"]["rows"] == first["totals"]["rows"] + new_rows
    written = pq.read_table(out / "data", columns=["id", "num_generated_tokens", "error"])
    new = written.filter(pds.field("id").isin(["n0", "n1"]))
    assert new.num_rows == new_rows and new.column("error").null_count == new_rows
    assert grown["totals"]["generated_tokens"] == first["totals"]["generated_tokens"] + sum(
        new.column("num_generated_tokens").to_pylist()
    )


def test_totals_stream_batch_by_batch_with_exact_percentiles():
    rng = np.random.default_rng(0)
    n = 1001
    ok = rng.random(n) > 0.1
    nfe = rng.integers(1, 90, n)
    steps = nfe * rng.integers(1, 4, n)
    tokens = rng.integers(0, 64, n)
    shares = nfe / rng.integers(1, 9, n)  # forwards of 1 to 8 requests
    walls = rng.random(n) * 10
    reused, computed = rng.integers(0, 300, n), rng.integers(0, 64, n)
    prefill = rng.random(n) / 10
    kinds = [None if good else ("input", "generation")[i % 2] for i, good in enumerate(ok)]
    table = pa.table(
        {
            "error": [None if good else f"generation failed: {i % 3}" for i, good in enumerate(ok)],
            "finish_reason": np.where(ok, np.where(tokens > 32, "eos", "length"), "error"),
            "num_prompt_tokens": rng.integers(5, 50, n),
            "num_generated_tokens": pa.array(tokens, mask=~ok),
            "nfe": pa.array(nfe, mask=~ok),
            "steps": pa.array(steps, mask=~ok),
            "accepted_steps_per_forward": pa.array(steps / nfe, mask=~ok),
            "forward_share": pa.array(shares, mask=~ok),
            "wall_seconds": pa.array(walls, mask=~ok),
            "prompt_tokens_reused": pa.array(reused, mask=~ok),
            "prompt_tokens_computed": pa.array(computed, mask=~ok),
            "prefill_seconds": pa.array(prefill, mask=~ok),
            "error_kind": pa.array(kinds, pa.string()),
        }
    )
    streamed = Totals()
    old = 200  # the first rows come from parts written before the last six columns existed
    new_columns = ["forward_share", *table.column_names[-5:]]
    for batch in table.slice(0, old).drop_columns(new_columns).to_batches(97):
        streamed.add(batch)
    for batch in table.slice(old).to_batches(max_chunksize=97):
        streamed.add(batch)
    got = streamed.as_dict()
    assert got["rows"] == n and got["errors"] == n - ok.sum()
    assert got["generated_tokens"] == tokens[ok].sum()
    assert got["prompt_tokens"] == table.column("num_prompt_tokens").to_numpy()[ok].sum()
    assert got["finish_reasons"] == dict(Counter(table.column("finish_reason").to_pylist()))
    assert got["error_kinds"] == {
        f"generation failed: {k}": sum(1 for i in range(n) if not ok[i] and i % 3 == k)
        for k in range(3)
    }
    assert got["nfe_mean"] == pytest.approx(nfe[ok].mean())
    assert got["nfe_total"] == nfe[ok].sum()
    assert (got["nfe_p50"], got["nfe_p95"]) == (
        np.percentile(nfe[ok], 50),
        np.percentile(nfe[ok], 95),
    )
    assert got["steps_per_nfe"] == pytest.approx(steps[ok].sum() / nfe[ok].sum())
    assert got["accepted_steps_per_forward_mean"] == pytest.approx((steps / nfe)[ok].mean())
    assert got["generated_tokens_per_nfe"] == pytest.approx(tokens[ok].sum() / nfe[ok].sum())
    shared = ok & (np.arange(n) >= old)
    assert got["requests_per_forward"] == pytest.approx(nfe[shared].sum() / shares[shared].sum())
    assert got["errors_by_kind"] == dict(Counter(k for k in kinds[old:] if k))
    assert got["prompt_tokens_reused"] == reused[shared].sum()
    assert got["prompt_tokens_computed"] == computed[shared].sum()
    assert got["prefill_seconds"] == pytest.approx(prefill[shared].sum())
    busy = (walls * shares / nfe)[shared].sum()  # each row's wall over its requests per forward
    assert got["prefill_share"] == pytest.approx(prefill[shared].sum() / busy)
    for values in (nfe, np.array([7]), np.array([3, 3, 3, 9]), rng.integers(0, 5, 17)):
        for q in (0, 1, 5, 25, 50, 62.5, 95, 99.9, 100):
            assert histogram_percentile(Counter(values.tolist()), q) == np.percentile(values, q)
    assert Totals().as_dict() == {"rows": 0, "errors": 0, "generated_tokens": 0}


def test_pending_count_is_exact_whatever_the_slice():
    """count_pending matches its keys a slice at a time: every slicing gives the count a
    key-by-key check gives, duplicated ids counted once per row."""
    rng = np.random.default_rng(1)
    ids = [f"r{i}" for i in rng.integers(0, 40, 60)] + ["\x00null"]
    plan = SimpleNamespace(keys=pa.array(ids), num_rows=len(ids))
    written = {(f"r{i}", int(s)) for i, s in zip(rng.integers(0, 50, 70), rng.integers(0, 3, 70))}
    written |= {("\x00null", 0), ("gone", 1)}  # a row without id; a row no longer in the input
    done = row_keys(pa.array([i for i, _ in written]), pa.array([s for _, s in written]))
    expected = sum((i, s) not in written for i in ids for s in range(3))
    assert 0 < expected < 3 * len(ids)
    for slice_rows in (1, 7, 64, 1 << 18):
        assert count_pending(plan, 3, done, slice_rows=slice_rows) == expected
    assert count_pending(plan, 2, pa.array([], pa.string())) == 2 * len(ids)


@pytest.mark.parametrize("batch,replicas", [(8, 1), (8, 4), (64, 16)])
def test_blocks_feed_every_replica_and_stay_few(batch, replicas, tmp_path):
    """A block is whole batches' worth for small runs, at most 32 batches for large ones, and
    larger still only where a run would otherwise cut more than MAX_BLOCKS_PER_RUN blocks
    (the driver holds statistics of every block until the run ends)."""
    job = parse_job(
        job_dict(tmp_path / "in.parquet", tmp_path / "model", tmp_path / "out")
        | {"resources": {"replicas": replicas, "batch_size": batch, "num_cpus": 1}}
    )
    for pending in (1, batch, 3 * batch * replicas, 10**5, 10**6, 5 * 10**7, 10**9):
        block = rows_per_block(pending, job)
        blocks = -(-pending // block)
        assert block >= min(batch, pending) and blocks <= MAX_BLOCKS_PER_RUN
        if pending >= 4 * batch * replicas:  # enough for a few batches per replica
            assert blocks >= min(replicas * 4, pending // (32 * batch))
        if block > 32 * batch:  # grown past 32 batches only to respect the cap
            assert -(-pending // (block - 1)) > MAX_BLOCKS_PER_RUN
    assert rows_per_block(5 * 10**7, job) == max(32 * batch, 5000)


_REPLICA_NICENESS = """
import os, sys, ray
from pipeline.job import parse_job
from pipeline.runner import ray_session
job = parse_job(
    {"name": "n", "input": {"path": "x"}, "model": {"path": "m"}, "output": {"path": "o"}}
)
with ray_session(job, None):
    print(ray.get(ray.remote(lambda: os.nice(0)).remote()))
"""


@pytest.mark.e2e
def test_the_embedded_ray_runs_replicas_at_normal_priority():
    """Ray starts its workers at niceness 15; the embedded session's replicas must not yield
    the CPU to every other process on the machine."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_worker_niceness"}
    done = subprocess.run(
        [sys.executable, "-c", _REPLICA_NICENESS],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-1] == "0"
