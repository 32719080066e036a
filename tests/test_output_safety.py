"""What protects an output, through the real CLI: resume refuses rows of another input, one
submit writes an output at a time, a killed submit's run is recorded as lost, failed
generations are retried, and writes that fail (a full disk, a file system gone read-only)
end in one line and resume exactly.

The refusals run nothing and stay in the default suite; the runs (each starting its own
embedded Ray) are marked e2e."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest
import yaml
from click.testing import CliRunner

from pipeline.cli import main
from pipeline.fingerprint import claim_output
from pipeline.inputs import plan_input
from pipeline.job import parse_job
from pipeline.lease import LOCK_FILE, Lease
from pipeline.output import OutputDir, part_run, write_atomically, write_part
from spot.builtin import resolve_builtin
from tests.pipeline_fixtures import output_rows, run_cli, start_cli

HELDOUT = resolve_builtin("prompts/heldout.jsonl")
LOCAL = pafs.LocalFileSystem()


def _prompts(path: Path, rows: int, start: int = 0, edit=None) -> list[dict]:
    """The first `rows` held-out prompts (after `start`) as JSON Lines at `path`, each
    passed through `edit` first when given."""
    lines = [json.loads(line) for line in Path(HELDOUT).read_text().splitlines()]
    chosen = [edit(row) if edit else row for row in lines[start : start + rows]]
    path.write_text("".join(json.dumps(row) + "\n" for row in chosen))
    return chosen


def _job(root: Path, rows: int = 24, out: Path | None = None, gen_length: int = 16) -> Path:
    """A job on the bundled sdar-nano target: `rows` prompts, blocks of 8 rows (3 parts for
    24 rows), greedy, so that a row generated again is the same row."""
    _prompts(root / "prompts.jsonl", rows)
    job = {
        "name": "safety",
        "input": {"path": str(root / "prompts.jsonl")},
        "model": {"path": "builtin:sdar-nano", "dtype": "float32"},
        "drafter": {"kind": "none"},
        "decoding": {"gen_length": gen_length, "block_length": 16, "temperature": 0.0, "seed": 0},
        "resources": {"replicas": 1, "batch_size": 2, "num_cpus": 1},
        "output": {"path": str(out or root / "out")},
    }
    path = root / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def _keys(out: Path) -> list[tuple[str, int]]:
    """(id, sample_index) of every row in out/data, part by part."""
    keys = []
    for part in OutputDir(str(out)).part_files():
        table = pq.read_table(part, columns=["id", "sample_index"])
        keys += zip(table.column("id").to_pylist(), table.column("sample_index").to_pylist())
    return keys


def _files(root: Path) -> dict[str, int]:
    """Every file of an output and its mtime, but the lease's lock file (pipeline.lease),
    which the first submit that takes the lease makes, and which stays."""
    return {
        str(p): p.stat().st_mtime_ns for p in root.rglob("*") if p.is_file() and p.name != LOCK_FILE
    }


def _fabricated(root: Path, rows: int = 6) -> tuple[Path, Path]:
    """A job whose output holds its first `rows` rows, as a run leaves them (its
    fingerprint, its input's record, a part), made without a model."""
    job_file = _job(root, rows)
    job = parse_job(yaml.safe_load(job_file.read_text()))
    plan = plan_input(job.input)
    output = claim_output(job, plan)
    ids = plan.keys.to_pylist()
    prompts = [json.loads(line)["prompt"] for line in (root / "prompts.jsonl").open()]
    write_part(output, [output_rows(ids, prompts)], run="fabricated")
    return job_file, root / "out"


def _refusal(*args: str) -> list[str]:
    """The lines of a command that must exit 2 having run nothing."""
    result = CliRunner().invoke(main, list(args))
    assert result.exit_code == 2, result.output
    return result.output.splitlines()


def test_resume_refuses_another_input_and_changed_prompts_before_anything_runs(tmp_path: Path):
    job, out = _fabricated(tmp_path)
    before = _files(out)
    other = tmp_path / "other.jsonl"
    _prompts(other, 6, start=100)
    for command in ("validate", "submit"):
        lines = _refusal(command, str(job), "--set", f"input.path={other}")
        assert lines[1].startswith("  input: 6 id(s) written are not in the input (first: '0-")
        assert lines[1].endswith(
            f"input.path '{other}' is another input (the rows were made from "
            f"{tmp_path / 'prompts.jsonl'})"
        )
        assert lines[2:] == [
            "  submit with --overwrite to delete those rows and start again, or set another "
            "output.path"
        ]

    def reworded(row: dict) -> dict:
        return (
            {**row, "prompt": row["prompt"] + " Show your work."} if row["id"] in changed else row
        )

    written = [json.loads(line)["id"] for line in (tmp_path / "prompts.jsonl").open()]
    changed = {written[1], written[4]}
    _prompts(tmp_path / "reworded.jsonl", 6, edit=reworded)
    lines = _refusal("submit", str(job), "--set", f"input.path={tmp_path / 'reworded.jsonl'}")
    assert lines[1] == (
        f"  input: 2 id(s) written have another prompt in the input now (first: "
        f"{written[1]!r}, {written[4]!r}); resuming would keep the old prompts' completions"
    )
    assert _files(out) == before  # nothing written, no log, no lease left

    appended = _prompts(tmp_path / "prompts.jsonl", 8)[6:]  # two rows added to the same file
    lines = _refusal("submit", str(job))
    assert lines[1:] == [
        "  input: holds 8 rows, 6 when this output was last submitted; the 6 row(s) written "
        f"all match it; ids not generated yet: {appended[0]['id']!r}, {appended[1]['id']!r}, ...",
        "  submit with --extend to generate the new rows too, or --overwrite to start again",
    ]
    assert _files(out) == before


def test_an_output_held_by_a_live_submit_is_refused_and_reported(tmp_path: Path):
    job, out = _fabricated(tmp_path)
    held = Lease(OutputDir(str(out)), run_id="running-now")
    held.acquire()
    try:
        before = _files(out)
        for command in ("validate", "submit"):
            lines = _refusal(command, str(job), *(["--overwrite"] if command == "submit" else []))
            assert lines[1].startswith(
                f"  output.path: {out} is being written by another submit: submit run "
                f"running-now by "
            )
            assert f"(pid {os.getpid()}), started " in lines[1]
            assert lines[2] == (
                "  one submit writes an output at a time: wait for it to end, or stop it; a "
                "lease whose holder is gone is taken over"
            )
        assert _files(out) == before  # --overwrite deleted nothing
    finally:
        held.release(recorded=True)
    result = CliRunner().invoke(main, ["validate", str(job)])
    assert result.exit_code == 0, result.output


def _wait_for_part(out: Path, process: subprocess.Popen, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while not OutputDir(str(out)).part_files():
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, "no part written"
        time.sleep(0.2)


def _driver(out: Path) -> int:
    """The pid of the process that holds the output's lease: a submit's driver, which runs
    in a session of its own, a child of the command (pipeline.session)."""
    return json.loads((out / "lease.json").read_text())["pid"]


def _kill_submit(process: subprocess.Popen, out: Path) -> None:
    """Power loss: SIGKILL to the submit's driver, so nothing it would do on a signal runs;
    its command then exits."""
    os.kill(_driver(out), signal.SIGKILL)
    process.communicate()


def _summary(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())


def _adds_up(summary: dict) -> None:
    """Every row in the totals was written by exactly one run's record (minus the rows
    removed to be retried)."""
    runs = summary["runs"]
    written = sum(r["rows_written"] for r in runs) - sum(r.get("rows_retried", 0) for r in runs)
    assert written == summary["totals"]["rows"], runs


@pytest.mark.e2e
def test_appended_rows_are_generated_with_extend_only(tmp_path: Path):
    job = _job(tmp_path, rows=6)
    first = run_cli("submit", str(job))
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    appended = _prompts(tmp_path / "prompts.jsonl", 8)[6:]
    refused = run_cli("submit", str(job))
    assert refused.returncode == 2 and refused.stdout == ""
    assert f"ids not generated yet: {appended[0]['id']!r}, {appended[1]['id']!r}" in refused.stderr
    extended = run_cli("submit", str(job), "--extend")
    assert extended.returncode == 0, extended.stdout[-3000:] + extended.stderr[-3000:]
    assert (
        "[safety] input changed since this output's last submit; the 6 row(s) written all "
        "match it" in extended.stdout
    )
    assert "6 already written, 2 to generate" in extended.stdout
    keys = _keys(tmp_path / "out")
    assert len(keys) == len(set(keys)) == 8
    again = run_cli("validate", str(job))
    assert again.returncode == 0 and again.stdout.count("\n") == 1  # recorded: nothing to say


@pytest.mark.e2e
def test_two_submits_started_together_write_once(tmp_path: Path):
    job = _job(tmp_path, rows=16)
    out = tmp_path / "out"
    processes = [start_cli("submit", str(job)) for _ in range(2)]
    results = [p.communicate(timeout=900) for p in processes]
    codes = [p.returncode for p in processes]
    assert sorted(codes) == [0, 2], results
    _, refused = results[codes.index(2)]
    assert refused.splitlines()[0] == f"cannot submit {job}:"
    assert "is being written by another submit: submit run " in refused.splitlines()[1]
    holder = re.search(r"submit run (\S+) by .* \(pid (\d+)\)", refused)
    assert holder and int(holder[2]) not in (p.pid for p in processes)  # the winner's driver
    assert [r["run_id"] for r in _summary(out)["runs"]] == [holder[1]]  # it wrote the rows
    keys = _keys(out)
    assert len(keys) == len(set(keys)) == 16
    assert len(list((out / "logs").glob("submit-*.log"))) == 1  # the refused one ran nothing


@pytest.mark.e2e
def test_a_staggered_submit_is_refused_and_a_killed_one_is_taken_over(tmp_path: Path):
    """A runs and writes a part, then is stopped (SIGSTOP: a holder that hangs, so that B's
    start cannot outlast it); B is refused naming A; A is killed (SIGKILL); C takes the
    lease over, records A's run as lost with the rows its parts hold, and finishes: every
    row once, and the runs add up to the totals."""
    job = _job(tmp_path, rows=24)
    out = tmp_path / "out"
    a = start_cli("submit", str(job))
    _wait_for_part(out, a)
    driver = _driver(out)
    os.kill(driver, signal.SIGSTOP)
    run_id = json.loads((out / "lease.json").read_text())["run_id"]
    b = run_cli("submit", str(job))
    assert b.returncode == 2 and b.stdout == "", b.stderr
    assert b.stderr.splitlines()[1].startswith(
        f"  output.path: {out} is being written by another submit: submit run {run_id} by "
    )
    assert f"(pid {driver})" in b.stderr
    _kill_submit(a, out)

    c = run_cli("submit", str(job))
    assert c.returncode == 0, c.stdout[-3000:] + c.stderr[-3000:]
    output = OutputDir(str(out))
    by_a = sum(
        pq.read_metadata(part).num_rows
        for part in output.part_files()
        if part_run(output, part) == run_id
    )
    lines = c.stdout.splitlines()
    assert lines[0].startswith(f"[safety] took over the output's lease from submit run {run_id} ")
    assert lines[0].endswith(f"its process {driver} no longer runs")
    assert lines[1].startswith(f"[safety] run {run_id} (started ")
    assert f"ended without its record: recorded as lost, {by_a} rows and " in lines[1]
    assert f"{by_a} already written, {24 - by_a} to generate" in c.stdout
    keys = _keys(out)
    assert len(keys) == len(set(keys)) == 24
    summary = _summary(out)
    assert [r["status"] for r in summary["runs"]] == ["lost", "succeeded"]
    assert summary["runs"][0]["rows_written"] == by_a > 0
    assert summary["runs"][0]["generated_tokens"] > 0 and summary["runs"][0]["wall_seconds"] > 0
    _adds_up(summary)
    assert not (out / "lease.json").exists() and list((out / "runs").iterdir()) == []


def _fail_rows(part: str, ids: list[str], kind: str) -> None:
    """Turn the rows of `ids` in `part` into error rows of `kind`, as a run whose target
    raised would have written them; in place (same name, same metadata)."""
    table = pq.read_table(part)
    hit = pc.is_in(table.column("id"), value_set=pa.array(ids))
    failed = {
        "completion": None,
        "completion_token_ids": None,
        "num_generated_tokens": None,
        "finish_reason": "error",
        "error": "generation failed: RuntimeError: transient",
    }
    for name, value in failed.items():
        column = table.column(name)
        index = table.schema.get_field_index(name)
        table = table.set_column(
            index, name, pc.if_else(hit, pa.scalar(value, column.type), column)
        )
    if "error_kind" in table.column_names:
        before = table.column("error_kind")
        table = table.drop_columns(["error_kind"])
    else:
        before = pa.nulls(table.num_rows, pa.string())
    table = table.append_column("error_kind", pc.if_else(hit, pa.scalar(kind), before))
    write_atomically(LOCAL, part, lambda f: pq.write_table(table, f))


def _tokens(out: Path) -> dict[str, list[int] | None]:
    rows = {}
    for part in OutputDir(str(out)).part_files():
        table = pq.read_table(part, columns=["id", "completion_token_ids"])
        rows.update(
            zip(table.column("id").to_pylist(), table.column("completion_token_ids").to_pylist())
        )
    return rows


@pytest.mark.e2e
def test_failed_generations_are_retried_unless_told_not_to(tmp_path: Path):
    """Rows whose generation failed (made so here: the engine decides error_kind) are
    generated again by a resubmit, input errors are kept; a submit killed right after it
    removed them leaves them pending, never duplicated."""
    job = _job(tmp_path, rows=8)
    out = tmp_path / "out"
    first = run_cli("submit", str(job))
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    reference = _tokens(out)
    part = OutputDir(str(out)).part_files()[0]
    ids = pq.read_table(part, columns=["id"]).column("id").to_pylist()
    _fail_rows(part, ids[:2], "generation")
    _fail_rows(part, ids[2:3], "input")

    kept = run_cli("submit", str(job), "--no-retry-failed")
    assert kept.returncode == 0 and "8 already written, 0 to generate" in kept.stdout

    killed = start_cli("submit", str(job))
    line = killed.stdout.readline()
    assert (
        line == "[safety] 2 row(s) whose generation failed are generated again "
        "(--no-retry-failed keeps them)\n"
    )
    _kill_submit(killed, out)  # before its run wrote anything
    assert len(_keys(out)) == 6

    again = run_cli("submit", str(job))
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "recorded as lost, 0 rows and 0 tokens" in again.stdout
    assert "6 already written, 2 to generate" in again.stdout
    keys = _keys(out)
    assert len(keys) == len(set(keys)) == 8
    tokens = _tokens(out)
    assert {i: tokens[i] for i in ids[:2]} == {
        i: reference[i] for i in ids[:2]
    }  # greedy: same rows
    assert tokens[ids[2]] is None  # the input error stays
    summary = _summary(out)
    assert [r["status"] for r in summary["runs"]] == ["succeeded", "succeeded", "lost", "succeeded"]
    assert summary["runs"][2]["rows_retried"] == 2
    _adds_up(summary)


@pytest.fixture
def mount(tmp_path: Path):
    """mount(folder): a 2 MiB tmpfs of its own at `folder` (skipped where this process may
    not mount one), unmounted afterwards."""
    mounted: list[Path] = []

    def mount_at(folder: Path) -> Path:
        folder.mkdir(parents=True, exist_ok=True)
        command = ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(folder)]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
        mounted.append(folder)
        return folder

    yield mount_at
    for folder in reversed(mounted):
        subprocess.run(["umount", "-l", str(folder)], check=False)


def _fill(disk: Path) -> Path:
    """Fill `disk` to its last byte; returns the filler file."""
    filler = disk / "filler"
    descriptor = os.open(filler, os.O_WRONLY | os.O_CREAT)
    with contextlib.suppress(OSError):  # until no space is left
        while os.write(descriptor, b"\0" * 4096):
            pass
    os.close(descriptor)
    return filler


def _remount(folder: Path, mode: str) -> None:
    """Remount `folder` read-only or read-write; a write in progress there makes the
    kernel refuse (busy) for a moment."""
    for _ in range(200):
        if subprocess.run(["mount", "-o", f"remount,{mode}", str(folder)]).returncode == 0:
            return
        time.sleep(0.05)
    raise AssertionError(f"cannot remount {folder} {mode}")


@pytest.mark.e2e
@pytest.mark.parametrize("fault", ["full", "read-only"])
def test_a_write_error_ends_in_one_line_and_resumes_exactly(tmp_path: Path, mount, fault):
    """After the first part, the output's file system fills up, or its data/ folder (a file
    system of its own) is remounted read-only: the submit ends with one line naming the
    path and the cause, no traceback; the summary is written where it can be (the run
    `failed`), else the next submit records the run as lost. Once the fault is gone, a
    resubmit completes every row once."""
    out = mount(tmp_path / "disk") / "out"
    if fault == "read-only":
        mount(out / "data")
    job = _job(tmp_path, rows=24, out=out)
    a = start_cli("submit", str(job))
    _wait_for_part(out, a)
    if fault == "full":
        filler = _fill(out.parent)
    else:
        _remount(out / "data", "ro")
    stdout, stderr = a.communicate(timeout=900)
    cause = "No space left on device" if fault == "full" else "Read-only file system"
    assert a.returncode == 1, stdout + stderr
    lines = stderr.splitlines()
    assert lines[0].startswith(f"[safety] failed: OutputWriteError: cannot write {out}/data/")
    assert lines[0].endswith(f".parquet: {cause}"), lines[0]
    assert lines[1].startswith("  the rows written are kept; the full log: ") and len(lines) == 2
    assert "Traceback" not in stdout + stderr
    unrecorded = f"  summary.json not written (cannot write {out}/summary.json: {cause})"
    assert (unrecorded in stdout) == (fault == "full"), stdout

    if fault == "full":
        filler.unlink()
    else:
        _remount(out / "data", "rw")
    written = len(_keys(out))
    again = run_cli("submit", str(job))
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert f"{written} already written, {24 - written} to generate" in again.stdout
    lost = f"ended without its record: recorded as lost, {written} rows"
    assert (lost in again.stdout) == (fault == "full"), again.stdout
    keys = _keys(out)
    assert len(keys) == len(set(keys)) == 24
    summary = _summary(out)
    first = "lost" if fault == "full" else "failed"
    assert [r["status"] for r in summary["runs"]] == [first, "succeeded"]
    _adds_up(summary)
