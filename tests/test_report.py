"""`spot-pipeline report` on an output written with the pipeline's own writers (parts and
summary.json): the opening paragraph made from its facts, speculation against draft-free
decoding, the budgets auto used per batch-size class, completion lengths and finish reasons,
runs of every status (succeeded, failed, interrupted, lost) and their batch failures, error
kinds with example rows, sample completions spread over the lengths."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest
from click.testing import CliRunner

from pipeline.cli import main
from pipeline.job import parse_job
from pipeline.output import OutputDir, write_part
from pipeline.report import Lengths, error_kind, run_error, run_status, speculation
from pipeline.schema import GENERATED_FIELDS, ID, PROMPT, SAMPLE_INDEX
from pipeline.summary import build_summary, output_totals
from tests.pipeline_fixtures import job_dict

GENERATED = 6  # rows with a completion: 40 steps in 20 forwards each
ERRORS = [
    "prompt too long: 600 tokens + gen_length 16 need 620 positions, the target accepts 256",
    "prompt too long: 900 tokens + gen_length 16 need 920 positions, the target accepts 256",
    "prompt is not a string (int)",
]


def _rows(start: int, budgets: list[dict] | None) -> pa.Table:
    """GENERATED generated rows, then one row per ERRORS, ids from `start`."""
    n = GENERATED + len(ERRORS)
    ok = [i < GENERATED for i in range(n)]
    columns = {f.name: [None] * n for f in GENERATED_FIELDS}
    columns.update(
        completion=[f"answer {start + i}" if good else None for i, good in enumerate(ok)],
        num_generated_tokens=[16 + (i % 2) * 2 - 1 if good else None for i, good in enumerate(ok)],
        nfe=[20 if good else None for good in ok],
        steps=[40 if good else None for good in ok],
        accepted_steps_per_forward=[2.0 if good else None for good in ok],
        forward_share=[5.0 if good else None for good in ok],  # in forwards of 4 requests
        finish_reason=[
            ("eos" if i % 3 else "length") if good else "error" for i, good in enumerate(ok)
        ],
        error=[None] * GENERATED + ERRORS,
    )
    columns["budget_iterations"][0] = budgets
    arrays = {ID: list(range(start, start + n)), PROMPT: [f"prompt {start + i}" for i in range(n)]}
    arrays.update({f.name: pa.array(columns[f.name], f.type) for f in GENERATED_FIELDS})
    arrays[SAMPLE_INDEX] = [0] * n
    arrays["error_kind"] = [None] * GENERATED + ["input"] * len(ERRORS)
    return pa.table(arrays)


def _run(status: str, error: str | None, rows: int) -> dict:
    return {
        "status": status,
        "error": error,
        "started_at": "2026-12-06T10:00:00+00:00",
        "wall_seconds": 36.0,
        "replicas": 1,
        "rows_written": rows,
        "generated_tokens": rows * 16,
        "tokens_per_second": rows * 16 / 36.0,
        "progress": [[10.0, 0, 0, 0], [20.0, 5, 80, 100], [30.0, rows, rows * 16, 180]],
    }


@pytest.fixture
def output(tmp_path: Path) -> Path:
    out = OutputDir(str(tmp_path / "out"))
    budgets = [
        {"batch_size_from": 1, "batch_size_to": 1, "budget": 3, "iterations": 30},
        {"batch_size_from": 8, "batch_size_to": 15, "budget": 0, "iterations": 10},
        {"batch_size_from": 8, "batch_size_to": 15, "budget": 2, "iterations": 25},
    ]
    write_part(out, [_rows(0, budgets)])
    write_part(out, [_rows(100, budgets[1:])])
    job = parse_job(
        job_dict(
            Path("prompts.parquet"),
            Path("model"),
            tmp_path / "out",
            drafter={"kind": "spot", "path": "drafter.safetensors", "budget": "auto"},
            cost={"usd_per_replica_hour": 3.6},
        )
    )
    counted, _ = output_totals(out)
    runs = [_run("failed", "KeyboardInterrupt: ", 9), _run("succeeded", None, 9)]
    out.write_summary(build_summary(job, counted, runs))
    return tmp_path / "out"


def test_report_shows_what_speculation_saved_and_what_went_wrong(output: Path):
    result = CliRunner().invoke(main, ["report", str(output)])
    assert result.exit_code == 0, result.output
    text = result.output
    # the first paragraph, in words, from the summary's facts
    assert text.startswith(
        "18 rows, 6 errors, 1 min 12 s over 2 runs; SPOT saved 50.0% of forwards (2.00 "
        "decoding steps per forward): at batch 8 on CPU, budget auto drafted trees of 2 nodes "
        "most often (trees in 80% of iterations). 192 tokens at 2.7 tokens/s over the wall "
        "time. Completions are 16 tokens at the median (p90 17, longest 17); 8 ended "
        "at EOS, 4 at gen_length. 6 rows could not be generated; 4 with \u201cprompt too "
        "long: N tokens + gen_length N need N positions, the target accepts N\u201d (see "
        "Errors)."
    )
    # 12 generated rows: 480 steps (draft-free forwards) in 240 forwards
    assert "steps per forward                         2.000" in text
    assert "240 / 480 (240 saved, 50.0%)" in text
    assert "requests per forward (mean)               4.00" in text
    # 72 s of one replica at $3.6/h = $0.072 for 192 tokens; draft-free: twice the forwards
    assert "USD / 1M tokens                           375.0000" in text
    assert "USD / 1M tokens draft-free (at most)      750.0000" in text
    assert "tokens / s over the wall time             2.7" in text
    assert "  lengths p10 / p50 / p90 / p99 / max: 15 / 16 / 17 / 17 / 17 tokens (gen" in text
    assert "  eos: 8 (44.4%)\n  error: 6 (33.3%)\n  length: 4 (22.2%)" in text
    assert "batch size 1: budget 3 (30 iterations; by budget 3: 100%)" in text
    assert "batch size 8-15: budget 2 (70 iterations; by budget 0: 29%, 2: 71%)" in text
    assert "1. 2026-12-06T10:00:00+00:00 interrupted, 9 rows in 36.0 s" in text
    assert "2. 2026-12-06T10:00:00+00:00 succeeded, 9 rows in 36.0 s" in text
    kind = "prompt too long: N tokens + gen_length N need N positions, the target accepts N"
    assert f"  4  {kind}" in text and "  2  prompt is not a string (int)" in text

    page = (output / "report" / "index.html").read_text()
    assert page.index('<p class="lead">18 rows, 6 errors') < page.index("<h2>Summary</h2>")
    assert 'class="alert' not in page  # the last run succeeded
    assert "<h2>Runs (1 succeeded, 1 interrupted)</h2>" in page
    assert '<tr class="interrupted"><td>1</td>' in page and 'class="failed"' not in page
    assert f"{kind} (4 rows)" in page and "sample 0 (input): prompt too long: 600" in page
    for example in ERRORS[:2]:  # a kind shows rows that failed differently in their numbers
        assert example in page
    # every generated row (12, fewer than 20), shortest first
    assert page.count("<td>answer ") == page.count("<td>prompt ") == 12
    assert page.index("<td>answer 0</td>") < page.index("<td>answer 1</td>")  # 15 before 17
    assert "<h2>Batch failures" not in page
    for plot in (
        "completion_lengths.png",
        "nfe_histogram.png",
        "accepted_steps_per_forward.png",
        "tokens_per_second.png",
    ):
        assert (output / "report" / plot).read_bytes().startswith(b"\x89PNG")


@pytest.mark.parametrize(
    ("status", "error", "said"),
    [
        (
            "failed",
            "OSError: disk",
            "The last run failed (OSError: disk) after writing 9 rows; they are kept, and "
            "submitting again resumes.",
        ),
        (
            "interrupted",
            "stopped by SIGTERM",
            "The last run was interrupted (stopped by SIGTERM) after writing 9 rows; submit "
            "again to continue.",
        ),
        (
            "lost",
            "ended without writing its record (killed, its machine lost, or its disk full); "
            "counted from the parts it wrote",
            "The last run ended without writing its record (lost: killed, or its machine "
            "lost); the 9 rows it wrote are kept and counted; submit again to continue.",
        ),
    ],
)
def test_a_report_whose_last_run_did_not_succeed_says_so_first(output: Path, status, error, said):
    out = OutputDir(str(output))
    summary = out.read_summary()
    summary["runs"].append({**summary["runs"][-1], "status": status, "error": error})
    out.write_summary(summary)
    result = CliRunner().invoke(main, ["report", str(output)])
    assert result.exit_code == 0 and f"3. 2026-12-06T10:00:00+00:00 {status}" in result.output
    assert said in result.output.splitlines()[0]  # the opening paragraph
    page = (output / "report" / "index.html").read_text()
    assert f'<p class="alert {status}">{said}</p>' in page.replace("&#x27;", "'")
    assert page.index('class="alert') < page.index("<h2>Summary</h2>")
    assert f'<tr class="{status}"><td>3</td>' in page


def test_lost_runs_and_batch_failures_are_counted_in_words_and_tables(output: Path):
    """A run that ended without its record (recorded as lost by the next run) and batch
    failures (each run's `batch_failures`: their count and first lines), as the runs that
    find them write them."""
    out = OutputDir(str(output))
    summary = out.read_summary()
    lost = {**summary["runs"][0], "status": "lost", "error": "ended without its record"}
    lost.update(rows_written=4, progress=[])
    failing = {"count": 5, "by_error": {"RuntimeError: boom": 3, "OutOfMemoryError: CUDA": 1}}
    summary["runs"] = [lost, {**summary["runs"][1], "batch_failures": failing}]
    out.write_summary(summary)
    result = CliRunner().invoke(main, ["report", str(output)])
    assert result.exit_code == 0, result.output
    words = result.output.splitlines()[0]
    assert (
        "1 earlier run ended without writing its record (lost); the 4 rows written then are "
        "counted. 5 batches failed in generation, 3 of them with \u201cRuntimeError: boom\u201d."
    ) in words
    assert "batch failures (first line of the error):\n  3  RuntimeError: boom\n" in result.output
    assert "  1  OutOfMemoryError: CUDA\n  1  (not recorded)" in result.output
    page = (output / "report" / "index.html").read_text()
    assert "<h2>Runs (1 succeeded, 1 lost)</h2>" in page and '<tr class="lost"><td>1</td>' in page
    assert "<h2>Batch failures (5 batches)</h2>" in page
    assert "<tr><td>3</td><td>RuntimeError: boom</td></tr>" in page


def test_samples_spread_over_the_lengths():
    lengths = Lengths()
    for length in range(1, 101):
        lengths.counts[length] += 1
        lengths.keys[length].append((f"r{length}", 0))
    chosen = lengths.spread(20)
    assert len(chosen) == len(set(chosen)) == 20
    assert chosen[0] == ("r1", 0) and chosen[-1] == ("r100", 0)
    picked = sorted(int(key[1:]) for key, _ in chosen)
    assert max(b - a for a, b in zip(picked, picked[1:])) <= 6  # evenly spread
    few = Lengths()
    few.counts[16] = 3
    few.keys[16] = [("a", 0), ("b", 0), ("c", 0)]
    assert few.spread(20) == [("a", 0), ("b", 0), ("c", 0)]  # fewer rows than asked: all


def test_error_kinds_and_speculation_by_hand():
    assert error_kind("f.jsonl line 12: not valid JSON (x, column 7)") == (
        "f.jsonl line N: not valid JSON (x, column N)"
    )
    assert error_kind("/tmp/h3/p.jsonl line 2: y") == "/tmp/h3/p.jsonl line N: y"
    totals = {"nfe_total": 200, "steps_per_nfe": 1.25, "generated_tokens": 1000}
    saving = speculation({"totals": totals, "cost_usd": 2.0})
    assert saving["steps"] == 250 and saving["forwards_saved"] == 50
    assert saving["draft_free_cost_usd"] == pytest.approx(2.5)
    assert speculation({"totals": {"rows": 3}}) is None  # nothing generated yet
    assert run_error({"error": "\x1b[36mray::Map()\x1b[39m (pid=1)"}) == "ray::Map() (pid=1)"
    assert run_status({"status": "failed", "error": "KeyboardInterrupt: "}) == "interrupted"
    assert run_status({"status": "lost", "error": "ended without its record"}) == "lost"
