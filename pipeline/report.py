"""`spot-pipeline report OUTPUT_DIR`: what a job did, printed and as an HTML page.

The page (OUTPUT_DIR/report/index.html, beside its plots nfe_histogram.png,
accepted_steps_per_forward.png and tokens_per_second.png) shows, from summary.json and a few
columns of the part files:
- the totals: rows, errors, tokens, NFE, the mean number of requests in a target forward
  (how full continuous batching kept the replicas' batches), the cost and USD per 1M tokens;
- speculation against draft-free decoding: draft-free decoding takes one target forward per
  decoding step, so its NFE is the steps taken; forwards saved = steps - NFE, and draft-free
  cost is the cost scaled by steps / NFE (its forwards are narrower than verification
  forwards and it runs no drafter, so this overstates the saving: an upper bound);
- the tree budget `auto` used per batch-size class (the `budget_iterations` column);
- every run, failed and interrupted ones marked, with their error;
- error kinds with example rows, and a few sample completions;
- throughput over time, per run, from the progress records the run kept as it went.
"""

from __future__ import annotations

import html
import os
import re
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import click
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as pds

from pipeline.estimate import cluster_rows, corpus_projection
from pipeline.output import REPORT_DIR, OutputDir

PLOTS = ("nfe_histogram.png", "accepted_steps_per_forward.png", "tokens_per_second.png")
SAMPLES = 5  # sample completions shown
EXAMPLES = 3  # example rows per error kind
KINDS = 10  # error kinds shown


def number(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, int):
        return f"{value:,}"
    return f"{value:,.{digits}f}"


def speculation(summary: dict[str, Any]) -> dict[str, float] | None:
    """Steps, NFE, steps per forward, forwards saved and the draft-free cost (cost scaled by
    steps / NFE: an upper bound of the saving, see the module docstring). None before any
    row was generated."""
    totals = summary["totals"]
    nfe = totals.get("nfe_total")
    if not nfe:
        return None
    steps = round(totals["steps_per_nfe"] * nfe)
    cost = summary.get("cost_usd") or 0.0
    tokens = totals.get("generated_tokens") or 0
    draft_free_cost = cost * steps / nfe
    return {
        "steps": steps,
        "nfe": nfe,
        "steps_per_forward": steps / nfe,
        "forwards_saved": steps - nfe,
        "saved_share": (steps - nfe) / steps if steps else 0.0,
        "draft_free_cost_usd": draft_free_cost,
        "draft_free_usd_per_million_tokens": draft_free_cost / tokens * 1e6 if tokens else None,
    }


def summary_rows(summary: dict[str, Any]) -> list[tuple[str, str]]:
    """(label, value) lines of the summary table."""
    job = summary["job"]
    totals = summary["totals"]
    priced = bool(summary.get("cost_usd"))
    saving = speculation(summary)
    rows = [
        ("job", job["name"]),
        ("model", f"{job['model']['path']} ({job['model']['dtype']})"),
        ("drafter", drafter_text(job["drafter"])),
        (
            "decoding",
            f"gen {job['decoding']['gen_length']}, block {job['decoding']['block_length']}, "
            f"{job['decoding']['rule']}, T={job['decoding']['temperature']}, "
            f"seed {job['decoding']['seed']}",
        ),
        ("rows", number(totals["rows"])),
        ("errors", number(totals["errors"])),
        ("generated tokens", number(totals["generated_tokens"])),
        (
            "NFE mean / p50 / p95",
            " / ".join(number(totals.get(k), 1) for k in ("nfe_mean", "nfe_p50", "nfe_p95")),
        ),
        ("tokens per NFE", number(totals.get("generated_tokens_per_nfe"), 3)),
        ("requests per forward (mean)", number(totals.get("requests_per_forward"), 2)),
    ]
    if saving is not None:
        rows += [
            ("steps per forward", number(saving["steps_per_forward"], 3)),
            (
                "forwards (NFE): speculative / draft-free",
                f"{saving['nfe']:,} / {saving['steps']:,} "
                f"({saving['forwards_saved']:,} saved, {saving['saved_share']:.1%})",
            ),
        ]
    rows += [
        ("runs", number(len(summary["runs"]))),
        ("wall time (s)", number(summary["wall_seconds"], 1)),
        ("replica-hours", number(summary["replica_hours"], 4)),
        ("tokens / s", number(summary["tokens_per_second"], 1)),
        *cluster_rows(summary),
        ("cost (USD)", number(summary["cost_usd"], 4) if priced else "- (no price set)"),
        ("USD / 1M tokens", number(summary["usd_per_million_tokens"], 4) if priced else "-"),
    ]
    if saving is not None and priced:
        rows.append(
            (
                "USD / 1M tokens draft-free (at most)",
                number(saving["draft_free_usd_per_million_tokens"], 4),
            )
        )
    return rows


def drafter_text(drafter: dict[str, Any]) -> str:
    if drafter["kind"] == "none":
        return "none (draft-free)"
    return f"{drafter['kind']} {drafter.get('path') or '(bundled)'}, budget {drafter['budget']}"


def format_table(rows: list[tuple[str, str]]) -> str:
    width = max(len(label) for label, _ in rows)
    return "\n".join(f"{label:<{width}}  {value}" for label, value in rows)


def run_status(run: dict[str, Any]) -> str:
    """succeeded, failed, or interrupted (stopped by Ctrl-C or a signal)."""
    if run.get("status") != "failed":
        return run.get("status", "succeeded")
    error = run.get("error") or ""
    return "interrupted" if error.startswith(("KeyboardInterrupt", "SystemExit")) else "failed"


def budget_classes(output: OutputDir) -> dict[tuple[int, int], Counter]:
    """{(smallest, largest batch size): {budget: iterations}} summed over the output's
    `budget_iterations` column (budget auto only; empty otherwise)."""
    found: dict[tuple[int, int], Counter] = defaultdict(Counter)
    files = output.part_files()
    if not files:
        return found
    dataset = pds.dataset(files, filesystem=output.filesystem, format="parquet")
    if "budget_iterations" not in dataset.schema.names:
        return found
    column = dataset.to_table(
        columns=["budget_iterations"], filter=pc.field("budget_iterations").is_valid()
    ).column(0)
    for entries in column.to_pylist():
        for e in entries:
            found[e["batch_size_from"], e["batch_size_to"]][e["budget"]] += e["iterations"]
    return dict(sorted(found.items()))


def budget_lines(summary: dict[str, Any], classes: dict[tuple[int, int], Counter]) -> list[str]:
    """What the tree budget was: fixed, draft-free, or auto's choice per batch-size class
    (the budget most iterations ran at, and the share of each)."""
    drafter = summary["job"]["drafter"]
    if drafter["kind"] == "none":
        return ["draft-free (no drafter): every forward verifies one step"]
    if drafter["budget"] != "auto":
        return [f"fixed budget {drafter['budget']} ({drafter['kind']})"]
    if not classes:
        return [
            "budget auto: no iterations recorded (no rows generated yet, or an output "
            "written before the budget_iterations column)"
        ]
    lines = []
    for (low, high), counts in classes.items():
        total = sum(counts.values())
        chosen, _ = counts.most_common(1)[0]
        shares = ", ".join(f"{b}: {n / total:.0%}" for b, n in sorted(counts.items()))
        sizes = f"{low}" if low == high else f"{low}-{high}"
        lines.append(
            f"batch size {sizes}: budget {chosen} ({total:,} iterations; by budget {shares})"
        )
    return lines


def _dataset(output: OutputDir) -> pds.Dataset | None:
    files = output.part_files()
    if not files:
        return None
    return pds.dataset(files, filesystem=output.filesystem, format="parquet")


def error_kind(error: str) -> str:
    """An error with its numbers as N: rows that failed the same way share a kind
    ("prompt too long: N tokens ...", "FILE line N: not valid JSON (..., column N)")."""
    return re.sub(r"\b\d+(\.\d+)?\b", "N", error)


def error_examples(output: OutputDir) -> list[tuple[str, int, list[dict]]]:
    """[(kind, rows, example rows)] of the most frequent error kinds, a few rows each (id,
    sample_index, error); reads the error rows' three columns, a batch at a time."""
    dataset = _dataset(output)
    if dataset is None:
        return []
    counts: Counter[str] = Counter()
    examples: dict[str, list[dict]] = defaultdict(list)
    columns = ["id", "sample_index", "error"]
    for batch in dataset.to_batches(columns=columns, filter=pc.field("error").is_valid()):
        for row in batch.to_pylist():
            kind = error_kind(row["error"])
            counts[kind] += 1
            if len(examples[kind]) < EXAMPLES:
                examples[kind].append(row)
    return [(kind, n, examples[kind]) for kind, n in counts.most_common(KINDS)]


def sample_completions(output: OutputDir) -> list[dict[str, Any]]:
    """The first few generated rows (no error): id, prompt, completion, how it ended."""
    dataset = _dataset(output)
    if dataset is None:
        return []
    columns = ["id", "sample_index", "prompt", "completion", "finish_reason", "nfe"]
    columns += ["num_generated_tokens"]
    return dataset.head(SAMPLES, columns=columns, filter=pc.field("error").is_null()).to_pylist()


def write_plots(output: OutputDir, summary: dict[str, Any], report_dir: Path) -> list[str]:
    """The three PNG plots; returns their file names."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = output.read(["nfe", "accepted_steps_per_forward", "error"])
    ok = pc.is_null(table.column("error")) if table is not None else None
    nfe = _values(table, "nfe", ok)
    accepted = _values(table, "accepted_steps_per_forward", ok)

    figure, axes = plt.subplots(figsize=(6, 4))
    axes.hist(nfe, bins=min(40, max(1, len(np.unique(nfe)))), color="tab:blue")
    axes.set(xlabel="NFE (target forwards) per sample", ylabel="samples", title="NFE per sample")
    figure.tight_layout()
    figure.savefig(report_dir / PLOTS[0], dpi=100)
    plt.close(figure)

    figure, axes = plt.subplots(figsize=(6, 4))
    axes.hist(accepted, bins=40, color="tab:green")
    axes.set(
        xlabel="decoding steps advanced per target forward",
        ylabel="samples",
        title="Steps per forward (1.0 = draft-free)",
    )
    figure.tight_layout()
    figure.savefig(report_dir / PLOTS[1], dpi=100)
    plt.close(figure)

    figure, axes = plt.subplots(figsize=(6, 4))
    for index, run in enumerate(summary["runs"]):
        seconds, tokens = throughput(run)
        if len(seconds) > 1:
            label = f"run {index + 1} ({run_status(run)})"
            if run.get("tokens_per_second") is not None:
                label += f": {run['tokens_per_second']:,.1f} tok/s over the run"
            axes.step(seconds, tokens, where="post", marker="o", markersize=3, label=label)
    axes.set(
        xlabel="seconds since the run started",
        ylabel="generated tokens",
        title="Throughput (slope: tokens / s)",
    )
    if axes.lines:
        axes.legend()
    else:
        axes.text(0.5, 0.5, "no progress records", ha="center", transform=axes.transAxes)
    figure.tight_layout()
    figure.savefig(report_dir / PLOTS[2], dpi=100)
    plt.close(figure)
    return list(PLOTS)


def throughput(run: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    """A run's progress records ([seconds since start, rows, tokens, NFE], as the run kept
    them while it went) as (seconds, tokens generated by then), from (0, 0)."""
    records = np.asarray(run.get("progress") or [], dtype=np.float64).reshape(-1, 4)
    seconds = np.concatenate([[0.0], records[:, 0]])
    tokens = np.concatenate([[0.0], records[:, 2]])
    return seconds, tokens


def _values(table: pa.Table | None, name: str, ok) -> np.ndarray:
    if table is None:
        return np.zeros(0)
    return pc.filter(table.column(name), ok).to_numpy(zero_copy_only=False).astype(np.float64)


def _cells(row: list[Any], tag: str = "td") -> str:
    return "".join(f"<{tag}>{html.escape(str(v))}</{tag}>" for v in row)


def _table(
    header: list[str], rows: list[list[Any]], classes: list[str] | None = None, kind: str = ""
) -> str:
    body = "\n".join(
        f'<tr class="{classes[i] if classes else ""}">{_cells(r)}</tr>' for i, r in enumerate(rows)
    )
    opening = f'<table class="{kind}">' if kind else "<table>"
    return f"{opening}<tr>{_cells(header, 'th')}</tr>\n{body}</table>"


def _happened(status: str) -> str:
    return "was interrupted" if status == "interrupted" else status


def _rows(count: int) -> str:
    return f"{count:,} row" + ("" if count == 1 else "s")


def _clip(text: Any, limit: int) -> str:
    if text is None:
        return ""
    text = str(text)
    return text if len(text) <= limit else text[:limit] + " …"


def write_html(
    summary: dict[str, Any], rows: list[tuple[str, str]], report_dir: Path, output: OutputDir
) -> Path:
    name = html.escape(summary["job"]["name"])
    sections = []
    runs = summary["runs"]
    last = runs[-1] if runs else None
    if last is not None and run_status(last) != "succeeded":
        reason = (last.get("error") or "").rstrip(": ")
        sections.append(
            f'<p class="alert">The last run {_happened(run_status(last))} ({html.escape(reason)}). '
            "Submitting the job again resumes it: the rows already written are kept.</p>"
        )
    totals = "\n".join(
        f"<tr><th>{html.escape(label)}</th><td>{html.escape(value)}</td></tr>"
        for label, value in rows
    )
    sections.append(f'<h2>Summary</h2><table class="summary">{totals}</table>')
    saving = speculation(summary)
    if saving is not None:
        sections.append(
            "<p class=note>Draft-free decoding takes one target forward per decoding step, so "
            "its NFE is the steps taken. Its cost is this job's cost scaled by steps / NFE: "
            "an upper bound of the saving, since draft-free forwards are narrower and run no "
            "drafter.</p>"
        )
    budgets = budget_lines(summary, budget_classes(output))
    sections.append(
        "<h2>Tree budget</h2><ul>"
        + "".join(f"<li>{html.escape(line)}</li>" for line in budgets)
        + "</ul>"
    )
    run_rows = [
        [
            i + 1,
            r.get("started_at", "-"),
            run_status(r),
            number(r.get("wall_seconds"), 1),
            number(r.get("rows_written")),
            number(r.get("tokens_per_second"), 1),
            r.get("error") or "",
        ]
        for i, r in enumerate(runs)
    ]
    header = ["run", "started (UTC)", "status", "wall s", "rows written", "tokens/s", "error"]
    sections.append("<h2>Runs</h2>" + _table(header, run_rows, [run_status(r) for r in runs]))
    examples = error_examples(output)
    if examples:
        parts = []
        for kind, count, found in examples:
            items = "".join(
                f"<li>id {html.escape(str(e['id']))}, sample {e['sample_index']}: "
                f"{html.escape(_clip(e['error'], 300))}</li>"
                for e in found
            )
            parts.append(
                f"<h3>{html.escape(_clip(kind, 120))} ({_rows(count)})</h3><ul>{items}</ul>"
            )
        sections.append(
            f"<h2>Errors ({_rows(summary['totals']['errors'])})</h2>"
            "<p class=note>A kind is the error with its numbers as N.</p>" + "".join(parts)
        )
    else:
        sections.append("<h2>Errors</h2><p>No row failed.</p>")
    samples = [
        [
            s["id"],
            s["sample_index"],
            _clip(s["prompt"], 200),
            _clip(s["completion"], 400),
            s["finish_reason"],
            s["num_generated_tokens"],
            s["nfe"],
        ]
        for s in sample_completions(output)
    ]
    header = ["id", "sample", "prompt", "completion", "finish", "tokens", "NFE"]
    sections.append("<h2>Sample completions</h2>" + _table(header, samples, kind="samples"))
    images = "\n".join(f'<img src="{plot}" alt="{plot}">' for plot in PLOTS)
    sections.append(
        f"<h2>Plots</h2>{images}<p class=note>Throughput comes from the progress records "
        "each run kept as it went; its legend gives the run's tokens/s over its whole wall "
        "time, start-up included.</p>"
    )
    versions = ", ".join(f"{k} {v}" for k, v in summary["versions"].items())
    page = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>{name}</title>
<style>
body{{font-family:sans-serif;margin:2em;max-width:1150px}}
table{{border-collapse:collapse;margin:0.5em 0}}
th,td{{text-align:left;padding:0.2em 0.8em;border-bottom:1px solid #ddd;vertical-align:top}}
td{{white-space:pre-wrap;word-break:break-word}}
td:first-child{{white-space:nowrap}}
table.samples td:nth-child(3),table.samples td:nth-child(4){{width:38%}}
tr.failed td,tr.interrupted td{{background:#fde8e8}}
.alert{{background:#fde8e8;border-left:4px solid #c0392b;padding:0.6em 1em}}
.note{{color:#555;font-size:0.9em}}
img{{max-width:32%;margin:0.5%}}
</style></head>
<body><h1>{name}</h1>
{"".join(sections)}
<p class=note>{html.escape(versions)}</p>
</body></html>
"""
    path = report_dir / "index.html"
    path.write_text(page)
    return path


def make_report(output_path: str) -> tuple[str, Path]:
    """Print-ready text and the report folder (plots + index.html) of a job's output."""
    output = OutputDir(output_path)
    summary = output.read_summary()
    if summary is None:
        raise FileNotFoundError(f"no summary.json in {output_path}; has the job run?")
    if "://" in output.uri:
        raise ValueError("report writes local files; copy the output folder here first")
    report_dir = Path(output.root) / REPORT_DIR
    os.makedirs(report_dir, exist_ok=True)
    rows = summary_rows(summary)
    write_plots(output, summary, report_dir)
    write_html(summary, rows, report_dir, output)
    lines = [format_table(rows), "tree budget:"]
    lines += [f"  {line}" for line in budget_lines(summary, budget_classes(output))]
    lines.append("runs:")
    for i, run in enumerate(summary["runs"]):
        error = f": {run['error']}" if run.get("error") else ""
        lines.append(
            f"  {i + 1}. {run.get('started_at', '-')} {run_status(run)}, "
            f"{number(run.get('rows_written'))} rows in {number(run.get('wall_seconds'), 1)} s"
            f"{error}"
        )
    examples = error_examples(output)
    if examples:
        lines.append("errors by kind (numbers as N):")
        lines += [f"  {count:,}  {_clip(kind, 100)}" for kind, count, _ in examples]
    return "\n".join(lines), report_dir


@click.command("report")
@click.argument("output_dir", type=click.Path(exists=True, file_okay=False))
@click.option(
    "--corpus-tokens",
    type=float,
    default=None,
    help="Also project hours and cost of generating this many tokens (e.g. 1e9) at this "
    "job's measured rates on the job's cluster and larger ones.",
)
def report_command(output_dir: str, corpus_tokens: float | None) -> None:
    """Print the summary of OUTPUT_DIR and write plots and an HTML page under it."""
    try:
        table, report_dir = make_report(output_dir)
        projection = None
        if corpus_tokens is not None:
            projection = corpus_projection(OutputDir(output_dir).read_summary(), corpus_tokens)
    except (FileNotFoundError, ValueError) as error:
        raise click.ClickException(str(error)) from error
    click.echo(table)
    if projection is not None:
        click.echo(projection)
    click.echo(f"plots and index.html in {report_dir}")
