"""One writer per output: the lease (atomic creation, refusal naming the holder, takeover of
a holder that is gone, the heartbeat), run markers and `lost` runs, retried rows, and
writes that fail. Real processes and files, no Ray (the CLI runs are in
tests/test_output_safety.py)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import fsspec
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

from pipeline import lease as lease_module
from pipeline.job import parse_job
from pipeline.lease import Holder, Lease, OutputHeld, check_lease, read_lease, read_markers
from pipeline.output import (
    OutputDir,
    OutputWriteError,
    part_run,
    write_atomically,
    write_error,
    write_part,
)
from pipeline.retry import parts_to_retry, remove_for_retry
from pipeline.summary import output_totals, record_lost_runs
from tests.pipeline_fixtures import job_dict, output_rows


def _write_lease(output: OutputDir, holder: Holder) -> None:
    Path(output.root).mkdir(parents=True, exist_ok=True)
    Path(output.root, "lease.json").write_text(json.dumps(asdict(holder)))


def test_a_second_lease_is_refused_naming_the_holder(tmp_path: Path):
    output = OutputDir(str(tmp_path / "out"))
    first = Lease(output, run_id="run-1")
    assert first.acquire() is None
    holder = read_lease(output)
    assert (holder.run_id, holder.pid, holder.host) == ("run-1", os.getpid(), socket.gethostname())
    with pytest.raises(OutputHeld) as refused:
        Lease(output, run_id="run-2").acquire()
    assert refused.value.problems[0].startswith(
        f"output.path: {output.uri} is being written by another submit: submit run run-1 by "
    )
    assert f"on {socket.gethostname()} (pid {os.getpid()})" in refused.value.problems[0]
    with pytest.raises(OutputHeld):
        check_lease(output)  # what validate says
    first.release(recorded=True)
    assert read_lease(output) is None and check_lease(output) is None
    Lease(output, run_id="run-3").acquire()


def _dead_process_holder() -> Holder:
    """The holder a process that has since exited would have written."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    holder = replace(Holder.this_process("dead", "submit"), pid=child.pid)
    holder = replace(holder, process=lease_module._process_identity(child.pid))
    child.kill()
    child.wait()
    return holder


def test_the_lease_of_a_process_that_is_gone_is_taken_over(tmp_path: Path):
    output = OutputDir(str(tmp_path / "out"))
    dead = _dead_process_holder()
    _write_lease(output, dead)
    note = check_lease(output)
    assert note.endswith(f"its process {dead.pid} no longer runs: a submit takes it over")
    taken = Lease(output, run_id="next").acquire()
    assert taken.startswith("took over the output's lease from submit run dead by ")
    assert taken.endswith(f"its process {dead.pid} no longer runs")
    assert read_lease(output).run_id == "next"


def test_a_reused_pid_is_not_its_holder(tmp_path: Path):
    output = OutputDir(str(tmp_path / "out"))
    mine = Holder.this_process("old", "submit")
    kernel, tick = mine.process.rsplit("/", 1)
    _write_lease(output, replace(mine, process=f"{kernel}/{int(tick) - 1}"))  # started before
    assert "no longer runs" in Lease(output, run_id="new").acquire()


def test_another_machines_lease_is_taken_over_when_its_heartbeat_is_stale(tmp_path: Path):
    output = OutputDir(str(tmp_path / "out"))
    far = replace(Holder.this_process("far", "submit"), host="elsewhere", process=None)
    _write_lease(output, replace(far, heartbeat=time.time() - 30))
    with pytest.raises(OutputHeld) as refused:
        Lease(output).acquire()
    assert "on elsewhere (pid" in refused.value.problems[0]
    assert "last heartbeat 30 s ago" in refused.value.problems[0]
    _write_lease(output, replace(far, heartbeat=time.time() - lease_module.STALE_SECONDS - 5))
    assert "its last heartbeat is 125 s old (more than 120 s)" in Lease(output).acquire()


def test_an_unreadable_lease_is_taken_over(tmp_path: Path):
    output = OutputDir(str(tmp_path / "out"))
    Path(output.root).mkdir(parents=True)
    Path(output.root, "lease.json").write_text("{half a lea")
    assert Lease(output).acquire().endswith("its lease file cannot be read")


# a contender: waits for the start file, tries the lease, prints what it got, and stays
# alive (holding it) until the done file appears
CONTENDER = """
import os, sys, time
from pipeline.lease import Lease, OutputHeld
from pipeline.output import OutputDir
root, start, done = sys.argv[1:]
print("ready", flush=True)
while not os.path.exists(start):
    time.sleep(0.001)
try:
    Lease(OutputDir(root)).acquire()
    print("held", flush=True)
except OutputHeld:
    print("refused", flush=True)
while not os.path.exists(done):
    time.sleep(0.01)
"""


@pytest.mark.parametrize("stale_holder", [False, True])
def test_contenders_started_together_get_one_lease(tmp_path: Path, stale_holder: bool):
    """Six processes released at once, onto a free output or one whose holder died:
    exactly one holds the lease."""
    output = OutputDir(str(tmp_path / "out"))
    if stale_holder:
        _write_lease(output, _dead_process_holder())
    start, done = tmp_path / "start", tmp_path / "done"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    command = [sys.executable, "-c", CONTENDER, output.root, str(start), str(done)]
    processes = [
        subprocess.Popen(command, env=env, stdout=subprocess.PIPE, text=True) for _ in range(6)
    ]
    assert [process.stdout.readline().strip() for process in processes] == ["ready"] * 6
    start.touch()
    try:
        outcomes = sorted(process.stdout.readline().strip() for process in processes)
    finally:
        done.touch()
        for process in processes:
            process.wait(timeout=60)
    assert outcomes == ["held"] + ["refused"] * 5
    assert sorted(os.listdir(output.root)) == [".lease.lock", "lease.json"]  # no temporaries


def test_the_heartbeat_refreshes_the_lease_and_notices_a_lost_one(tmp_path: Path, monkeypatch):
    monkeypatch.setattr(lease_module, "HEARTBEAT_SECONDS", 0.05)
    output = OutputDir(str(tmp_path / "out"))
    lost: list[str] = []
    held = Lease(output, run_id="mine", on_lost=lost.append)
    held.acquire()
    held.mark_run(replicas=2)
    first = read_lease(output).heartbeat
    time.sleep(0.5)
    assert read_lease(output).heartbeat > first
    [marker] = read_markers(output)
    assert marker["run_id"] == "mine" and marker["last_seen"] > first
    _write_lease(output, replace(read_lease(output), run_id="thief"))
    time.sleep(0.5)
    assert len(lost) == 1 and lost[0].startswith(
        "this run lost the output's lease (now held by submit run thief by "
    )
    held.release(recorded=False)
    assert read_lease(output).run_id == "thief"  # not its own: left alone
    assert [m["run_id"] for m in read_markers(output)] == ["mine"]  # not recorded: kept


def _memory_output(monkeypatch) -> OutputDir:
    """An output on a file system that is not local (fsspec's memory file system through
    pyarrow), as an object store is."""
    monkeypatch.setattr(lease_module, "SETTLE_SECONDS", 0.0)
    output = OutputDir.__new__(OutputDir)
    output.filesystem = pafs.PyFileSystem(pafs.FSSpecHandler(fsspec.filesystem("memory")))
    output.root, output.uri = f"/lease-test-{os.getpid()}-{time.time_ns()}", "memory://out"
    return output


def test_an_object_store_lease_is_written_then_verified(monkeypatch):
    output = _memory_output(monkeypatch)
    first = Lease(output, run_id="store-1")
    assert first.acquire() is None and read_lease(output).run_id == "store-1"
    with pytest.raises(OutputHeld):
        Lease(output, run_id="store-2").acquire()
    first.release(recorded=True)
    far = replace(Holder.this_process("far", "submit"), host="elsewhere", process=None)
    text = json.dumps(asdict(replace(far, heartbeat=0.0))).encode()
    write_atomically(output.filesystem, f"{output.root}/lease.json", lambda f: f.write(text))
    assert "its last heartbeat is" in Lease(output, run_id="store-3").acquire()


def _job(tmp_path: Path):
    return parse_job(job_dict(tmp_path / "in.jsonl", "builtin:sdar-nano", tmp_path / "out"))


def test_a_run_without_its_record_is_recorded_as_lost(tmp_path: Path):
    job = _job(tmp_path)
    output = OutputDir(job.output.path)
    write_part(output, [output_rows(["a", "b"], ["x", "y"], tokens=4)], run="done-run")
    output.write_summary(
        {
            "runs": [
                {
                    "run_id": "done-run",
                    "status": "succeeded",
                    "wall_seconds": 1.0,
                    "replicas": 1,
                    "rows_written": 2,
                    "started_at": "2026-01-01T00:00:00+00:00",
                }
            ]
        }
    )
    killed = Lease(output, run_id="killed-run")
    killed.acquire()
    killed.mark_run(replicas=2)
    write_part(output, [output_rows(["c", "d", "e"], ["z", "w", "v"], tokens=7)], run="killed-run")
    write_part(output, [output_rows(["f"], ["u"], tokens=7)], run="killed-run")
    [part] = [p for p in output.part_files() if part_run(output, p) == "done-run"]
    assert pq.read_schema(part).metadata[b"spot_pipeline.run"] == b"done-run"
    # killed: its lease and marker stay; the next submit takes the lease over ...
    Path(output.root, "lease.json").unlink()
    lines: list[str] = []
    [lost] = record_lost_runs(output, job, "next-run", lines.append)
    assert (lost["status"], lost["rows_written"], lost["generated_tokens"]) == ("lost", 4, 28)
    assert lost["replicas"] == 2 and lost["wall_seconds"] >= 0
    summary = output.read_summary()
    assert [r["run_id"] for r in summary["runs"]] == ["done-run", "killed-run"]
    assert summary["totals"]["rows"] == sum(r["rows_written"] for r in summary["runs"]) == 6
    assert lines == [
        f"[test] run killed-run (started {lost['started_at']}) ended without its record: "
        f"recorded as lost, 4 rows and 28 tokens in {lost['wall_seconds']:.0f} s"
    ]
    assert read_markers(output) == []
    assert record_lost_runs(output, job, "next-run", lines.append) == []  # once only


def test_failed_generations_are_removed_for_retry_without_duplicates(tmp_path: Path, monkeypatch):
    output = OutputDir(str(tmp_path / "out"))
    good = output_rows(["a", "b"], ["x", "y"], samples=2)
    failed = output_rows(
        ["c"], ["z"], samples=2, error="generation failed: Boom", error_kind="generation"
    )
    bad = output_rows(["d"], [None], error="prompt is null", error_kind="input")
    old = output_rows(["e"], ["v"], error="generation failed: Old").drop_columns(["error_kind"])
    write_part(output, [good, failed], run="r1")
    write_part(output, [failed.slice(0, 0), bad, old], run="r1")
    write_part(
        output,
        [output_rows(["f"], ["u"], error="generation failed", error_kind="generation")],
        run="r2",
    )
    parts = list(parts_to_retry(output))
    assert sorted(count for _, count in parts) == [1, 2]

    # a crash half way: the first part rewritten, the second not
    import pipeline.retry as retry

    calls = []

    def dies_on_second(filesystem, path, write):
        calls.append(path)
        if len(calls) == 2:
            raise OutputWriteError(f"cannot write {path}: killed")
        write_atomically(filesystem, path, write)

    monkeypatch.setattr(retry, "write_atomically", dies_on_second)
    parts_with_survivors = [path for path, count in parts if count == 2]  # the part with "a", "b"
    with pytest.raises(OutputWriteError):
        remove_for_retry(output, [*parts_with_survivors, *parts_with_survivors])
    table = pq.read_table(output.data)
    keys = list(zip(table.column("id").to_pylist(), table.column("sample_index").to_pylist()))
    assert len(keys) == len(set(keys))  # never two rows for one key
    assert ("c", 0) not in keys and ("a", 1) in keys
    assert part_run(output, parts_with_survivors[0]) == "r1"  # the rewrite keeps its metadata
    monkeypatch.undo()

    assert remove_for_retry(output, [path for path, _ in parts_to_retry(output)]) == 1
    kept = pq.read_table(output.data).column("id").to_pylist()
    assert sorted(kept) == ["a", "a", "b", "b", "d", "e"]  # input errors and unknown kinds stay
    assert list(parts_to_retry(output)) == []
    counted, _ = output_totals(output)
    assert counted["rows"] == 6


def test_a_failed_write_names_the_path_and_the_cause(tmp_path: Path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    output = OutputDir(str(blocker / "out"))
    with pytest.raises(OutputWriteError) as failed:
        write_part(output, [output_rows(["a"], ["x"])])
    message = str(failed.value)
    assert message.startswith(f"cannot write {blocker}/out/data/part-") and "\n" not in message
    assert message.endswith(".parquet: Not a directory"), message
    arrow = OSError("Failed to write. Detail: [errno 28] No space left on device")
    assert str(write_error("/x", arrow)) == "cannot write /x: No space left on device"
