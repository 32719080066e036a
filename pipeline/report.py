"""`spot-pipeline report OUTPUT_DIR`: the summary as a table, three plots and an HTML page.

Files go to OUTPUT_DIR/report/: nfe_histogram.png, accepted_steps_per_forward.png,
tokens_per_second.png and index.html.
"""

from __future__ import annotations

import html
import os
from pathlib import Path
from typing import Any

import click
import numpy as np
import pyarrow.compute as pc

from pipeline.estimate import cluster_rows, corpus_projection
from pipeline.output import REPORT_DIR, OutputDir

PLOTS = ("nfe_histogram.png", "accepted_steps_per_forward.png", "tokens_per_second.png")


def summary_rows(summary: dict[str, Any]) -> list[tuple[str, str]]:
    """(label, value) lines of the summary table."""
    job = summary["job"]
    totals = summary["totals"]

    def number(value: Any, digits: int = 2) -> str:
        if value is None:
            return "-"
        if isinstance(value, int):
            return f"{value:,}"
        return f"{value:,.{digits}f}"

    rows = [
        ("job", job["name"]),
        ("model", f"{job['model']['path']} ({job['model']['dtype']})"),
        ("drafter", job["drafter"]["kind"]),
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
        ("steps per NFE", number(totals.get("steps_per_nfe"), 3)),
        ("tokens per NFE", number(totals.get("generated_tokens_per_nfe"), 3)),
        ("runs", number(len(summary["runs"]))),
        ("wall time (s)", number(summary["wall_seconds"], 1)),
        ("replica-hours", number(summary["replica_hours"], 4)),
        ("tokens / s", number(summary["tokens_per_second"], 1)),
        *cluster_rows(summary),
        ("cost (USD)", number(summary["cost_usd"], 4)),
        ("USD / 1M tokens", number(summary["usd_per_million_tokens"], 4)),
    ]
    return rows


def format_table(rows: list[tuple[str, str]]) -> str:
    width = max(len(label) for label, _ in rows)
    return "\n".join(f"{label:<{width}}  {value}" for label, value in rows)


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
        title="Accepted steps per forward (1.0 = draft-free)",
    )
    figure.tight_layout()
    figure.savefig(report_dir / PLOTS[1], dpi=100)
    plt.close(figure)

    figure, axes = plt.subplots(figsize=(6, 4))
    for index, run in enumerate(summary["runs"]):
        progress = np.asarray(run.get("progress") or [[0.0, 0, 0, 0]], dtype=np.float64)
        seconds, tokens = progress[:, 0], progress[:, 2]
        rate = np.diff(tokens, prepend=0.0) / np.maximum(np.diff(seconds, prepend=0.0), 1e-9)
        axes.plot(seconds, rate, marker="o", label=f"run {index + 1}")
    axes.set(xlabel="seconds since start", ylabel="generated tokens / s", title="Throughput")
    axes.legend()
    figure.tight_layout()
    figure.savefig(report_dir / PLOTS[2], dpi=100)
    plt.close(figure)
    return list(PLOTS)


def _values(table, name: str, ok) -> np.ndarray:
    if table is None:
        return np.zeros(0)
    return pc.filter(table.column(name), ok).to_numpy(zero_copy_only=False).astype(np.float64)


def write_html(summary: dict[str, Any], rows: list[tuple[str, str]], report_dir: Path) -> Path:
    cells = "\n".join(
        f"<tr><th>{html.escape(label)}</th><td>{html.escape(value)}</td></tr>"
        for label, value in rows
    )
    images = "\n".join(f'<img src="{name}" alt="{name}">' for name in PLOTS)
    versions = ", ".join(f"{k} {v}" for k, v in summary["versions"].items())
    page = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>{html.escape(summary["job"]["name"])}</title>
<style>body{{font-family:sans-serif;margin:2em}}th{{text-align:left;padding-right:2em}}
img{{max-width:32%;margin:0.5%}}</style></head>
<body><h1>{html.escape(summary["job"]["name"])}</h1>
<table>{cells}</table>
{images}
<p><small>{html.escape(versions)}</small></p>
</body></html>
"""
    path = report_dir / "index.html"
    path.write_text(page)
    return path


def make_report(output_path: str) -> tuple[str, Path]:
    """Print-ready table and the report folder (plots + index.html) of a job's output."""
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
    write_html(summary, rows, report_dir)
    return format_table(rows), report_dir


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
