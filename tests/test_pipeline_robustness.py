"""Faults on a real local Ray: a replica that dies, a job interrupted and submitted again,
part files that appear whole or not at all."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.job import parse_job
from pipeline.output import OutputDir, write_atomically, write_part
from pipeline.runner import GenerationActor, run_job
from tests.pipeline_fixtures import (
    by_key,
    job_dict,
    local_ray,  # noqa: F401  (module fixture)
    make_tiny_sdar,
    read_output,
    word_prompts,
    write_prompts,
)

ROWS = 12


class DiesOnceActor(GenerationActor):
    """Kills its own process on its first batch of the job (once: a marker file remembers)."""

    def __call__(self, batch: pa.Table) -> pa.Table:
        marker = Path(self.engine.job.output.path + ".died")
        if not marker.exists():
            marker.write_text(str(os.getpid()))
            os._exit(1)
        return super().__call__(batch)


class InterruptedActor(GenerationActor):
    """Fails the job (an exception Ray does not retry) once the batch holding id r9 comes,
    after at least one part file is on disk: the job dies half written."""

    def __call__(self, batch: pa.Table) -> pa.Table:
        if "r9" in batch.column("id").to_pylist():
            output = OutputDir(self.engine.job.output.path)
            deadline = time.monotonic() + 120
            while not output.part_files() and time.monotonic() < deadline:
                time.sleep(0.2)
            raise RuntimeError("interrupted")
        return super().__call__(batch)


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("robust")
    prompts = write_prompts(
        root / "in" / "prompts.parquet",
        {"id": [f"r{i}" for i in range(ROWS)], "prompt": word_prompts(ROWS)},
    )
    return {"root": root, "model": make_tiny_sdar(root / "model"), "prompts": prompts}


def _job(setup, name: str, **sections):
    base = {"resources": {"replicas": 1, "batch_size": 2}}
    return parse_job(
        job_dict(setup["prompts"], setup["model"], setup["root"] / name, **{**base, **sections})
    )


def _ids(out: Path) -> list[str]:
    return sorted(read_output(out).column("id").to_pylist())


@pytest.fixture(scope="module")
def died_run(local_ray, setup):  # noqa: F811
    """A job whose replica kills itself on its first batch, watched by a reader polling the
    output folder: (job, summary, rows per part the reader saw, reader failures)."""
    job = _job(setup, "dies")
    data = Path(job.output.path) / "data"
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
        summary = run_job(job, actor_class=DiesOnceActor, echo=lambda line: None)
    finally:
        stop.set()
        thread.join()
    return job, summary, seen, failures


def test_a_replica_that_dies_is_restarted(died_run):
    job, summary, _, _ = died_run
    assert Path(job.output.path + ".died").exists()  # it did die
    assert _ids(Path(job.output.path)) == sorted(f"r{i}" for i in range(ROWS))
    assert summary["totals"]["rows"] == ROWS and summary["totals"]["errors"] == 0


def test_part_files_appear_whole(died_run):
    """A reader polling the output folder during the run reads every part it sees in full."""
    _, _, seen, failures = died_run
    assert failures == []
    assert sum(seen.values()) == ROWS and len(seen) >= 2


def test_an_interrupted_job_resumes_without_duplicates(local_ray, setup):  # noqa: F811
    job = _job(setup, "resume", decoding={"temperature": 0.5, "samples_per_prompt": 2})
    out = Path(job.output.path)
    with pytest.raises(Exception, match="interrupted"):
        run_job(job, actor_class=InterruptedActor, echo=lambda line: None)
    first = read_output(out)
    assert 0 < first.num_rows < ROWS * 2
    by_key(first)  # no duplicates so far
    kept = {p: os.path.getmtime(p) for p in OutputDir(str(out)).part_files()}
    stale = out / "data" / ".part-left-by-a-killed-writer.parquet.partial"
    stale.write_bytes(b"PAR1 half a file")

    lines: list[str] = []
    summary = run_job(job, echo=lines.append)
    assert f"{first.num_rows} already written" in lines[0]
    assert not stale.exists()
    assert all(os.path.getmtime(p) == t for p, t in kept.items())  # old parts untouched
    final = read_output(out)
    keys = by_key(final, "completion_token_ids")  # every (id, sample) exactly once
    assert sorted(keys) == sorted((f"r{i}", s) for i in range(ROWS) for s in (0, 1))
    assert summary["runs"][-1]["rows_written"] == ROWS * 2 - first.num_rows
    assert summary["totals"]["rows"] == ROWS * 2

    again = run_job(job, echo=lambda line: None)  # nothing left: writes nothing
    assert again["runs"][-1]["rows_written"] == 0
    assert read_output(out).num_rows == ROWS * 2
    assert [r["status"] for r in again["runs"]] == ["failed", "succeeded", "succeeded"]

    fresh = run_job(_job(setup, "fresh", **{"decoding": job.decoding.model_dump()}), echo=print)
    assert fresh["totals"]["rows"] == ROWS * 2
    assert (
        by_key(read_output(Path(job.output.path).parent / "fresh"), "completion_token_ids") == keys
    )


def test_a_write_that_dies_leaves_no_visible_file(tmp_path):
    output = OutputDir(str(tmp_path))
    table = pa.table({"id": ["a", "b"], "sample_index": [0, 0], "x": [1, 2]})

    def dies_half_way(stream) -> None:
        stream.write(b"PAR1" + b"\0" * 100)
        raise OSError("killed")

    with pytest.raises(OSError, match="killed"):
        write_atomically(output.filesystem, f"{output.data}/part-x.parquet", dies_half_way)
    assert output.part_files() == []
    assert output.remove_partial_files() == 1

    assert write_part(output, [table]) == 2
    assert write_part(output, [table.slice(1), table.slice(0, 1)]) == 2  # a retried write
    [part] = output.part_files()  # ... replaces its own file
    assert pq.read_table(part).num_rows == 2
