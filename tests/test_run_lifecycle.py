"""A run's life through the real CLI and its embedded Ray: signals that drain it (to the
driver and to its process group), failures inside generation that speak (tests/generation_
faults injects them into the replicas), and the prefix cache giving the rows a run without it
gives."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from pipeline.job import load_job
from pipeline.prompts import prompt_ids
from pipeline.text import load_tokenizer
from tests.pipeline_fixtures import job_dict, make_tiny_sdar, run_cli, word_prompts, write_prompts

REPO = Path(__file__).resolve().parents[1]
FAULTS = REPO / "tests" / "generation_faults"  # its sitecustomize fails the replicas' forwards
ROWS = 240
LINE = re.compile(r"^\[lifecycle\] interrupted: (\d+) rows kept, (\d+) left; resubmit to continue$")


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lifecycle")
    ids = [f"q{i}" for i in range(ROWS)]
    prompts = write_prompts(root / "prompts.parquet", {"id": ids, "prompt": word_prompts(ROWS)})
    return {"root": root, "model": make_tiny_sdar(root / "model"), "prompts": prompts}


def _job(made, name: str, rows: int = ROWS, **sections) -> Path:
    job = job_dict(
        made["prompts"],
        made["model"],
        made["root"] / name,
        decoding={"gen_length": 48},
        **sections,
    )
    job["name"] = "lifecycle"
    job["input"]["limit"] = rows
    path = made["root"] / f"{name}.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def _keys(out: Path) -> Counter:
    table = pq.read_table(out / "data", columns=["id", "sample_index"])
    return Counter(zip(table.column("id").to_pylist(), table.column("sample_index").to_pylist()))


def _interrupt(job: Path, signum: int, group: bool, tmp: Path, after_rows: int = 8):
    """Submit `job`, send `signum` to the driver or its process group once the progress
    shows `after_rows` rows done; (exit code, stdout, stderr, rows seen done then)."""
    environment = {**os.environ, "PYTHONPATH": str(REPO), "TMPDIR": str(tmp)}
    environment.pop("RAY_ADDRESS", None)
    stdout = tmp / "stdout"
    with open(stdout, "w") as out, open(tmp / "stderr", "w") as err:
        command = ["-m", "pipeline.cli", "submit", str(job), "--progress-interval", "0.5"]
        process = subprocess.Popen(
            [sys.executable, *command],
            cwd=REPO,
            env=environment,
            stdout=out,
            stderr=err,
            start_new_session=True,  # its own group, as a shell gives a command
        )
        seen, deadline = 0, time.monotonic() + 300
        while seen < after_rows and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
            done = re.findall(r"\[progress\] (\d+)/", stdout.read_text())
            seen = int(done[-1]) if done else 0
        assert process.poll() is None, "the run ended before the signal"
        (os.killpg if group else os.kill)(process.pid, signum)
        code = process.wait(timeout=120)
    return code, stdout.read_text(), (tmp / "stderr").read_text(), seen


def _check_interrupted(made, name: str, signum: int, group: bool, resubmit: bool) -> None:
    """A signal drains the run: exit 128 + signal, one true line, the rows done kept (the
    in-flight ones finished), the run recorded interrupted, no Ray folder left; with
    `resubmit`, a resubmit writes every other row, each (id, sample) once."""
    job = _job(made, name)
    out = made["root"] / name
    tmp = Path(tempfile.mkdtemp(prefix="sig-", dir="/tmp"))  # Ray's socket paths stay short
    code, stdout, stderr, seen = _interrupt(job, signum, group, tmp)
    assert code == 128 + signum, stdout[-2000:] + stderr[-2000:]
    [line] = stderr.splitlines()
    kept, left = (int(n) for n in LINE.match(line).groups())
    assert kept + left == ROWS and kept >= seen > 0
    assert sum(_keys(out).values()) == kept
    summary = json.loads((out / "summary.json").read_text())
    name_of = signal.Signals(signum).name
    [run] = summary["runs"]
    assert (run["status"], run["error"], run["rows_written"]) == (
        "interrupted",
        f"stopped by {name_of}",
        kept,
    )
    assert f"{name_of}: admitting no more rows" in stdout
    assert list(tmp.glob("spot-ray-*")) == []  # Ray's folder removed
    shutil.rmtree(tmp)
    if not resubmit:
        return

    again = run_cli("submit", str(job))
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
    assert f"{kept} already written, {left} to generate" in again.stdout
    keys = _keys(out)
    assert len(keys) == ROWS and set(keys.values()) == {1}


@pytest.mark.e2e
def test_sigterm_to_the_process_group_drains_the_run(made):
    """What a scheduler or `kill -TERM -<pgid>` sends: it reaches the command, not Ray."""
    _check_interrupted(made, "term-group", signal.SIGTERM, True, resubmit=True)


@pytest.mark.e2e
@pytest.mark.parametrize(
    ("signum", "group"),
    [(signal.SIGTERM, False), (signal.SIGINT, False), (signal.SIGINT, True)],
    ids=["sigterm-driver", "sigint-driver", "sigint-group"],
)
def test_a_signal_drains_the_run(made, signum, group):
    """The other signals and targets drain alike (what a resubmit then does is the same as
    after the test above)."""
    _check_interrupted(made, f"sig{signum}-{group}", signum, group, resubmit=False)


def _faulty(*plan: tuple[str, object]) -> dict[str, str]:
    return {
        "PYTHONPATH": f"{FAULTS}:{REPO}",
        "SPOT_TEST_GENERATION_FAULTS": json.dumps(dict(plan)),
    }


@pytest.mark.e2e
def test_a_row_whose_generation_fails_is_logged_counted_and_alone(made):
    """One row's forwards fail in the replica: that row is an error row of kind
    "generation", every other row is written as usual, the run succeeds, its log holds the
    traceback and its record counts the failed batches."""
    job = _job(made, "one-row", rows=24)
    parsed = load_job(job)
    tokenizer = load_tokenizer(parsed)
    ids = [prompt_ids(tokenizer, {"prompt": p}, parsed.input) for p in word_prompts(24)]
    unique = [(token, i) for i, row in enumerate(ids) for token in row]
    poison, victim = next((t, i) for t, i in unique if sum(t in row for row in ids) == 1)
    result = run_cli("submit", str(job), env=_faulty(("poison", poison)))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = made["root"] / "one-row"
    table = pq.read_table(out / "data", columns=["id", "error", "error_kind", "completion"])
    rows = {r["id"]: r for r in table.to_pylist()}
    message = (
        f"generation failed: RuntimeError: injected failure of a forward holding token {poison}"
    )
    assert rows.pop(f"q{victim}") == {
        "id": f"q{victim}",
        "error": message,
        "error_kind": "generation",
        "completion": None,
    }
    assert len(rows) == 23 and all(r["error"] is None for r in rows.values())
    [run] = json.loads((out / "summary.json").read_text())["runs"]
    failures = run["batch_failures"]
    assert failures["count"] >= 2 and list(failures["by_error"]) == [message.split(": ", 1)[1]]
    [log] = (out / "logs").glob("submit-*.log")
    text = log.read_text()
    assert "generation failed for a batch of" in text and "Traceback (most recent call" in text


@pytest.mark.e2e
def test_a_job_whose_every_forward_fails_stops_naming_the_error(made):
    """Every forward fails: the job stops once more than half of a replica's recent rows
    failed, exit 1, one line naming the most common error and example rows; the summary
    records the run failed with that message."""
    job = _job(made, "all-fail", rows=40)
    result = run_cli("submit", str(job), env=_faulty(("every", True)))
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    first = result.stderr.splitlines()[0]
    assert re.fullmatch(
        r"\[lifecycle\] failed: TooManyFailuresError: 8 of the last 8 rows failed in generation, "
        r"more than resources\.max_error_rate 0\.5; most common \(8 rows, e\.g\. q\d+, q\d+, "
        r"q\d+\): RuntimeError: injected failure of every forward",
        first,
    ), first
    [run] = json.loads((made["root"] / "all-fail" / "summary.json").read_text())["runs"]
    assert run["status"] == "failed" and run["error"] == first.removeprefix("[lifecycle] failed: ")


@pytest.mark.e2e
def test_a_shared_system_prompt_gives_the_same_rows_with_and_without_the_cache(made):
    """Rows behind a long system prompt, with the prefix cache (the default) and without:
    the same completions, forwards and steps; with it the prompt's blocks are reused and
    the summary gives the share of time spent on prompts."""
    system = "You are a careful maths tutor. " * 4  # ~70 of the 256 positions
    compared = ["id", "completion_token_ids", "nfe", "steps", "finish_reason"]
    tables = {}
    for name, size in (("cache-on", "auto"), ("cache-off", 0)):
        job = _job(
            made,
            name,
            rows=16,
            input={"system_prompt": system},
            resources={"prefix_cache_bytes": size},
        )
        result = run_cli("submit", str(job))
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        tables[name] = pq.read_table(made["root"] / name / "data").sort_by("id")
        summary = json.loads((made["root"] / name / "summary.json").read_text())
        assert 0 < summary["totals"]["prefill_share"] < 1
    on, off = tables["cache-on"], tables["cache-off"]
    assert on.select(compared).to_pylist() == off.select(compared).to_pylist()
    reused = sum(on.column("prompt_tokens_reused").to_pylist())
    assert sum(off.column("prompt_tokens_reused").to_pylist()) == 0
    assert reused > 10 * 48  # most of the system prompt, for most rows
    assert sum(on.column("prompt_tokens_computed").to_pylist()) < sum(
        off.column("prompt_tokens_computed").to_pylist()
    )
