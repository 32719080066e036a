"""`spot-pipeline report` on an output written with the pipeline's own writers (parts and
summary.json): speculation against draft-free decoding, the budgets auto used per batch-size
class, failed and interrupted runs, error kinds with example rows, sample completions."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest
from click.testing import CliRunner

from pipeline.cli import main
from pipeline.job import parse_job
from pipeline.output import OutputDir, write_part
from pipeline.report import error_kind, speculation
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
        num_generated_tokens=[16 if good else None for good in ok],
        nfe=[20 if good else None for good in ok],
        steps=[40 if good else None for good in ok],
        accepted_steps_per_forward=[2.0 if good else None for good in ok],
        forward_share=[5.0 if good else None for good in ok],  # in forwards of 4 requests
        finish_reason=["eos" if good else "error" for good in ok],
        error=[None] * GENERATED + ERRORS,
    )
    columns["budget_iterations"][0] = budgets
    arrays = {ID: list(range(start, start + n)), PROMPT: [f"prompt {start + i}" for i in range(n)]}
    arrays.update({f.name: pa.array(columns[f.name], f.type) for f in GENERATED_FIELDS})
    arrays[SAMPLE_INDEX] = [0] * n
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
    # 12 generated rows: 480 steps (draft-free forwards) in 240 forwards
    assert "steps per forward                         2.000" in text
    assert "240 / 480 (240 saved, 50.0%)" in text
    assert "requests per forward (mean)               4.00" in text
    # 72 s of one replica at $3.6/h = $0.072 for 192 tokens; draft-free: twice the forwards
    assert "USD / 1M tokens                           375.0000" in text
    assert "USD / 1M tokens draft-free (at most)      750.0000" in text
    assert "batch size 1: budget 3 (30 iterations; by budget 3: 100%)" in text
    assert "batch size 8-15: budget 2 (70 iterations; by budget 0: 29%, 2: 71%)" in text
    assert "1. 2026-12-06T10:00:00+00:00 interrupted, 9 rows in 36.0 s" in text
    assert "2. 2026-12-06T10:00:00+00:00 succeeded, 9 rows in 36.0 s" in text
    kind = "prompt too long: N tokens + gen_length N need N positions, the target accepts N"
    assert f"  4  {kind}" in text and "  2  prompt is not a string (int)" in text

    page = (output / "report" / "index.html").read_text()
    assert 'class="alert"' not in page  # the last run succeeded
    assert "<td>interrupted</td>" in page and 'class="failed"' not in page
    assert f"{kind} (4 rows)" in page
    for example in ERRORS[:2]:  # a kind shows rows that failed differently in their numbers
        assert example in page
    assert page.count("<td>answer ") == page.count("<td>prompt ") == 5  # sample completions
    for plot in ("nfe_histogram.png", "accepted_steps_per_forward.png", "tokens_per_second.png"):
        assert (output / "report" / plot).read_bytes().startswith(b"\x89PNG")


def test_a_report_whose_last_run_failed_says_so_first(output: Path):
    out = OutputDir(str(output))
    summary = out.read_summary()
    summary["runs"].append({**summary["runs"][-1], "status": "failed", "error": "OSError: disk"})
    out.write_summary(summary)
    result = CliRunner().invoke(main, ["report", str(output)])
    assert result.exit_code == 0 and "3. 2026-12-06T10:00:00+00:00 failed" in result.output
    page = (output / "report" / "index.html").read_text()
    assert '<p class="alert">The last run failed (OSError: disk)' in page
    assert page.index('class="alert"') < page.index("<h2>Summary</h2>")


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
