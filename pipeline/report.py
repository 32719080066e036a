"""`spot-pipeline report OUTPUT_DIR`: what a job did, in words first, printed and as an HTML
page.

The page (OUTPUT_DIR/report/index.html, beside its plots) opens with a paragraph made from
the summary's facts (`report_words`): rows, errors and time; what speculation saved and, for
budget auto, why it drafted as it did; the two rates; how completions ended and how long they
are; and what went wrong (the last run's status, lost runs, batch failures, error kinds).
Then, from summary.json and a few columns of the part files:
- the totals: rows, errors, tokens, NFE, the mean number of requests in a target forward
  (how full continuous batching kept the replicas' batches), the cost and USD per 1M tokens;
- speculation against draft-free decoding: draft-free decoding takes one target forward per
  decoding step, so its NFE is the steps taken; forwards saved = steps - NFE, and draft-free
  cost is the cost scaled by steps / NFE (its forwards are narrower than verification
  forwards and it runs no drafter, so this overstates the saving: an upper bound);
- completions: how they ended (finish reasons) and their lengths (percentiles, histogram);
- the tree budget `auto` used per batch-size class (the `budget_iterations` column);
- every run with its status (succeeded, failed, interrupted, lost), its two rates and its
  batch failures;
- error kinds with example rows, and about twenty completions spread over the lengths;
- throughput over time, per run, from the progress records the run kept as it went.

Tokens per second: a run's (and the job's) is its generated tokens over its wall time,
start-up included; "decoding" is the rate from a run's first finished batch to its last, as
its progress lines showed.
"""

from __future__ import annotations

import html
import os
import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as pds

from pipeline.estimate import cluster_rows, corpus_projection, format_duration
from pipeline.output import REPORT_DIR, OutputDir
from pipeline.summary import histogram_percentile

PLOTS = (
    "completion_lengths.png",
    "nfe_histogram.png",
    "accepted_steps_per_forward.png",
    "tokens_per_second.png",
)
SAMPLES = 20  # completions shown, spread over the completion lengths
EXAMPLES = 3  # example rows per error kind
KINDS = 10  # error kinds shown
RUN_STATUSES = ("succeeded", "failed", "interrupted", "lost")
PHASE_NAMES = {"ray": "Ray ready", "replicas_ready": "model loaded"}  # marked on throughput
DRAFTER_NAMES = {"spot": "SPOT", "spot-sets": "SPOT-Sets", "spiffy": "Spiffy"}
LENGTH_PERCENTILES = (10, 50, 90, 99)


def number(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, int):
        return f"{value:,}"
    return f"{value:,.{digits}f}"


def _count(n: int, noun: str, plural: str | None = None) -> str:
    return f"{n:,} " + (noun if n == 1 else plural or f"{noun}s")


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
        ("tokens / s over the wall time", number(summary["tokens_per_second"], 1)),
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
    if drafter.get("learn"):
        start = drafter.get("path") or "draft-free"
        return f"{drafter['kind']} learned in the job (from {start}), budget {drafter['budget']}"
    return f"{drafter['kind']} {drafter.get('path') or '(bundled)'}, budget {drafter['budget']}"


ROUND_HEADER = [
    "round",
    "kind",
    "rows used",
    "held-out steps/forward before -> after",
    "seconds",
    "adopted",
]


def learning_rounds(summary: dict[str, Any]) -> list[list[Any]]:
    """A learning job's rounds (summary.json's drafter_learning): rows used (train /
    validation / held out), held-out steps per forward of the drafter in use and of the
    new one at each budget, seconds learning and measuring, adopted or not."""
    learning = summary.get("drafter_learning") or {}
    rows = []
    for r in learning.get("rounds", []):
        before, after = r["steps_per_forward_before"], r["steps_per_forward_after"]
        slices = r["rows_by_slice"]
        rows.append(
            [
                r["round"],
                r["kind"],
                f"{r['rows']} ({slices['train']} / {slices['validation']} / {slices['heldout']})",
                ", ".join(
                    f"budget {b}: {before[b]:.3f} -> {after[b]:.3f}" for b in sorted(after, key=int)
                ),
                number(r["seconds"], 1),
                "yes" if r["adopted"] else "no",
            ]
        )
    return rows


def learning_lines(summary: dict[str, Any]) -> list[str]:
    """What the learner did, in lines (none for a job that did not learn)."""
    learning = summary.get("drafter_learning")
    if not learning:
        return []
    current = learning.get("current")
    restored = learning.get("rows_restored", 0)
    earlier = f", {restored:,} recorded by earlier runs" if restored else ""
    lines = [
        f"{learning['rows_received']:,} rows recorded ({learning['recording_seconds']:.1f} "
        f"replica-seconds){earlier}, {learning['rows']:,} taken; "
        f"{'stopped' if learning['stopped'] else 'learning on at the next run'}; in use: "
        f"{'none' if current is None else current.get('file') or current['path']}"
    ]
    if learning.get("error"):
        lines.append(f"learning failed: {learning['error']}")
    return lines


def format_table(rows: list[tuple[str, str]]) -> str:
    width = max(len(label) for label, _ in rows)
    return "\n".join(f"{label:<{width}}  {value}" for label, value in rows)


def run_status(run: dict[str, Any]) -> str:
    """One of RUN_STATUSES. Records written before `interrupted` existed said `failed` with
    the KeyboardInterrupt (or SystemExit) that stopped the run."""
    status = run.get("status", "succeeded")
    error = run.get("error") or ""
    if status == "failed" and error.startswith(("KeyboardInterrupt", "SystemExit")):
        return "interrupted"
    return status


def budget_classes(output: OutputDir) -> dict[tuple[int, int], Counter]:
    """{(smallest, largest batch size): {budget: iterations}} summed over the output's
    `budget_iterations` column (budget auto only; empty otherwise)."""
    found: dict[tuple[int, int], Counter] = defaultdict(Counter)
    dataset = _dataset(output)
    if dataset is None or "budget_iterations" not in dataset.schema.names:
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
        lines.append(
            f"batch size {_sizes(low, high)}: budget {chosen} ({total:,} iterations; "
            f"by budget {shares})"
        )
    return lines


def _sizes(low: int, high: int) -> str:
    return f"{low}" if low == high else f"{low}-{high}"


def _dataset(output: OutputDir) -> pds.Dataset | None:
    files = output.part_files()
    if not files:
        return None
    return pds.dataset(files, filesystem=output.filesystem, format="parquet")


# -- completions ------------------------------------------------------------------------------
@dataclass
class Lengths:
    """Generated tokens of the rows without an error, as a histogram (exact percentiles,
    memory bounded by the distinct lengths), with up to SAMPLES row keys (id, sample_index)
    of each length to show."""

    counts: Counter[int] = field(default_factory=Counter)
    keys: dict[int, list[tuple[Any, int]]] = field(default_factory=lambda: defaultdict(list))

    def percentile(self, q: float) -> float | None:
        return histogram_percentile(self.counts, q) if self.counts else None

    def spread(self, n: int = SAMPLES) -> list[tuple[Any, int]]:
        """Keys of up to `n` rows spread over the lengths: the row nearest each of `n`
        evenly spaced percentiles (shortest and longest included), each row once."""
        chosen: list[tuple[Any, int]] = []
        left = {length: list(keys) for length, keys in self.keys.items()}
        for i in range(min(n, self.counts.total())):
            target = self.percentile(100 * i / max(n - 1, 1))
            lengths = [length for length, keys in left.items() if keys]
            if not lengths:
                break
            nearest = min(lengths, key=lambda length: (abs(length - target), length))
            chosen.append(left[nearest].pop(0))
        return chosen


def completion_lengths(output: OutputDir) -> Lengths:
    """The generated rows' lengths, read a batch at a time from three columns."""
    lengths = Lengths()
    for batch in output.batches(["id", "sample_index", "num_generated_tokens", "error"]):
        good = batch.filter(pc.is_null(batch.column("error")))
        tokens = good.column("num_generated_tokens").to_pylist()
        lengths.counts.update(tokens)
        keys = zip(good.column("id").to_pylist(), good.column("sample_index").to_pylist())
        for length, key in zip(tokens, keys):
            if len(lengths.keys[length]) < SAMPLES:
                lengths.keys[length].append(key)
    return lengths


def sample_completions(output: OutputDir, lengths: Lengths) -> list[dict[str, Any]]:
    """About SAMPLES generated rows spread over the completion lengths, shortest first: id,
    prompt, completion, how it ended."""
    dataset = _dataset(output)
    wanted = lengths.spread()
    if dataset is None or not wanted:
        return []
    columns = ["id", "sample_index", "prompt", "completion", "finish_reason", "nfe"]
    columns += ["num_generated_tokens"]
    ids = pa.array(sorted({key[0] for key in wanted}, key=repr))
    rows = dataset.to_table(columns=columns, filter=pc.field("id").isin(ids)).to_pylist()
    found = {(row["id"], row["sample_index"]): row for row in rows}
    shown = [found[key] for key in wanted if key in found]
    return sorted(shown, key=lambda row: row["num_generated_tokens"])


def length_text(lengths: Lengths, gen_length: int) -> str:
    """ "p10 / p50 / p90 / p99 / max: 12 / 21 / 34 / 60 / 64 tokens (gen_length 64)": a
    completion may pass gen_length by up to a block where the block grid is absolute (the
    prompt's last partial block is decoded as the first, docs/design.md 1.1)."""
    if not lengths.counts:
        return "no completions yet"
    names = " / ".join([*(f"p{q}" for q in LENGTH_PERCENTILES), "max"])
    values = [lengths.percentile(q) for q in LENGTH_PERCENTILES] + [max(lengths.counts)]
    shown = " / ".join(f"{v:.0f}" for v in values)
    return f"{names}: {shown} tokens (gen_length {gen_length})"


def finish_rows(summary: dict[str, Any]) -> list[list[Any]]:
    """[reason, rows, share] of the output's rows, the most frequent first."""
    reasons = Counter(summary["totals"].get("finish_reasons") or {})
    total = sum(reasons.values())
    return [[reason, f"{n:,}", f"{n / total:.1%}"] for reason, n in reasons.most_common()]


# -- the words --------------------------------------------------------------------------------
def report_words(
    summary: dict[str, Any],
    classes: dict[tuple[int, int], Counter],
    lengths: Lengths,
    errors: list[tuple[str, int, list[dict]]],
    last_status: bool = True,
) -> str:
    """The report's first paragraph, made from the summary's facts: "64 rows, 0 errors,
    40.8 s; SPOT saved 3.7% of forwards: at batch 8 on CPU, trees cost more than they save,
    so budget auto drafted little (...)." and what follows it. `last_status`: say how the
    last run ended when it did not succeed (the page says it in a box of its own)."""
    totals, runs = summary["totals"], summary["runs"]
    opening = (
        f"{_count(totals['rows'], 'row')}, {_count(totals['errors'], 'error')}, "
        f"{format_duration(summary['wall_seconds'])}"
    )
    if len(runs) > 1:
        opening += f" over {len(runs)} runs"
    sentences = [f"{opening}; {_speculation_words(summary, classes)}."]
    sentences += _rate_words(summary)
    sentences += _completion_words(summary, lengths)
    sentences += _trouble_words(summary, errors, last_status)
    return " ".join(sentences)


def _speculation_words(summary: dict[str, Any], classes: dict[tuple[int, int], Counter]) -> str:
    saving = speculation(summary)
    drafter = summary["job"]["drafter"]
    if saving is None:
        return "nothing generated yet"
    if drafter["kind"] == "none":
        return f"draft-free decoding, {summary['totals']['nfe_mean']:.1f} target forwards per row"
    said = (
        f"{DRAFTER_NAMES.get(drafter['kind'], drafter['kind'])} saved "
        f"{saving['saved_share']:.1%} of forwards ({saving['steps_per_forward']:.2f} decoding "
        "steps per forward)"
    )
    if drafter["budget"] != "auto":
        return f"{said} with trees of {drafter['budget']} nodes"
    if not classes:
        return said
    total = sum(sum(counts.values()) for counts in classes.values())
    drafting = sum(n for counts in classes.values() for b, n in counts.items() if b > 0)
    share = drafting / total if total else 0.0
    job = summary["job"]
    device = "GPU" if job["resources"]["num_gpus"] else "CPU"
    # the batch-size class most iterations ran in (a class never exceeds the job's batch)
    low, high = max(classes, key=lambda key: sum(classes[key].values()))
    batch = f"batch {_sizes(low, max(low, min(high, job['resources']['batch_size'])))}"
    if share < 0.5:
        return (
            f"{said}: at {batch} on {device}, trees cost more than they save, so budget auto "
            f"drafted little (trees in {share:.0%} of iterations)"
        )
    budgets: Counter[int] = Counter()
    for counts in classes.values():
        budgets.update({b: n for b, n in counts.items() if b > 0})
    chosen = budgets.most_common(1)[0][0]
    return (
        f"{said}: at {batch} on {device}, budget auto drafted trees of {chosen} nodes most "
        f"often (trees in {share:.0%} of iterations)"
    )


def _rate_words(summary: dict[str, Any]) -> list[str]:
    rate = summary.get("tokens_per_second")
    if not rate:
        return []
    said = (
        f"{summary['totals']['generated_tokens']:,} tokens at {rate:,.1f} tokens/s over the "
        "wall time"
    )
    last = summary["runs"][-1]
    decoding = last.get("decode_tokens_per_second")
    if decoding:
        run = "" if len(summary["runs"]) == 1 else " in the last run"
        said += f" ({decoding:,.1f} tokens/s while decoding{run})"
    first_rows = (last.get("phases") or {}).get("first_rows")
    if first_rows and last.get("wall_seconds"):
        phases = last["phases"]
        parts = [f"Ray {format_duration(phases['ray'])}"] if "ray" in phases else []
        if "ray" in phases and "replicas_ready" in phases:
            loading = phases["replicas_ready"] - phases["ray"]
            parts.append(f"loading the model {format_duration(loading)}")
        said += (
            f"; start-up took {format_duration(first_rows)} of the "
            f"{'' if len(summary['runs']) == 1 else 'last '}run's "
            f"{format_duration(last['wall_seconds'])}"
        )
        if parts:
            said += f" ({', '.join(parts)})"
    return [said[0].upper() + said[1:] + "."]


FINISHED = {"eos": "at EOS", "length": "at gen_length", "stop": "at a stop string"}


def _completion_words(summary: dict[str, Any], lengths: Lengths) -> list[str]:
    if not lengths.counts:
        return []
    median, longest = lengths.percentile(50), max(lengths.counts)
    reasons = Counter(summary["totals"].get("finish_reasons") or {})
    reasons.pop("error", None)
    ends = [(f"{n:,}", FINISHED.get(reason, reason)) for reason, n in reasons.most_common()]
    ended = ""
    if ends:
        (n, where), rest = ends[0], ends[1:]
        ended = f"; {'all ' if not rest else ''}{n} ended {where}"
        ended += "".join(f", {n} {where}" for n, where in rest)
    return [
        f"Completions are {median:.0f} tokens at the median (p90 {lengths.percentile(90):.0f}, "
        f"longest {longest}){ended}."
    ]


def _trouble_words(
    summary: dict[str, Any], errors: list[tuple[str, int, list[dict]]], last_status: bool
) -> list[str]:
    """What went wrong, worst first: the last run's end, lost runs, batch failures, error
    rows and their most frequent kind (`error_examples`)."""
    said = []
    runs = summary["runs"]
    last = runs[-1] if runs else None
    if last_status and last is not None and run_status(last) != "succeeded":
        said.append(_status_sentence(last))
    lost = [r for r in runs[:-1] if run_status(r) == "lost"]
    if lost:
        rows = sum(r.get("rows_written") or 0 for r in lost)
        their = "its" if len(lost) == 1 else "their"
        said.append(
            f"{_count(len(lost), 'earlier run')} ended without writing {their} record (lost); "
            f"the {_count(rows, 'row')} written then are counted."
        )
    failures = batch_failures(runs)
    if failures:
        count = sum(failures.values())
        top, n = failures.most_common(1)[0]
        said.append(
            f"{_count(count, 'batch', 'batches')} failed in generation, {n:,} of them with "
            f"\u201c{_clip(top, 120)}\u201d."
        )
    failed_rows = summary["totals"]["errors"]
    if failed_rows:
        top = f"; {errors[0][1]:,} with \u201c{_clip(errors[0][0], 80)}\u201d" if errors else ""
        said.append(f"{_count(failed_rows, 'row')} could not be generated{top} (see Errors).")
    return said


def _status_sentence(run: dict[str, Any]) -> str:
    """The last run's end, when it did not succeed, and the way on."""
    status = run_status(run)
    reason = run_error(run).rstrip(": ")
    written = run.get("rows_written") or 0
    rows = _count(written, "row")
    if status == "interrupted":
        after = f"after writing {rows}" if written else "before writing any row"
        return f"The last run was interrupted ({reason}) {after}; submit again to continue."
    if status == "lost":
        return (
            f"The last run ended without writing its record (lost: killed, or its machine "
            f"lost); the {rows} it wrote are kept and counted; submit again to continue."
        )
    if not written:
        return f"The last run failed ({reason}) before writing any row; submit again to retry."
    return (
        f"The last run failed ({reason}) after writing {rows}; they are kept, and submitting "
        "again resumes."
    )


_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def run_error(run: dict[str, Any]) -> str:
    """A run's error as recorded, without the terminal colour codes Ray puts in its own."""
    return _ANSI.sub("", run.get("error") or "")


def batch_failures(runs: list[dict[str, Any]]) -> Counter[str]:
    """Failed generation batches by their error's first line, over every run."""
    found: Counter[str] = Counter()
    for run in runs:
        failures = run.get("batch_failures") or {}
        by_error = failures.get("by_error") or {}
        found.update(by_error)
        unnamed = (failures.get("count") or 0) - sum(by_error.values())
        if unnamed > 0:
            found["(not recorded)"] += unnamed
    return found


# -- errors -----------------------------------------------------------------------------------
def error_kind(error: str) -> str:
    """An error with its numbers as N: rows that failed the same way share a kind
    ("prompt too long: N tokens ...", "FILE line N: not valid JSON (..., column N)")."""
    return re.sub(r"\b\d+(\.\d+)?\b", "N", error)


def error_examples(output: OutputDir) -> list[tuple[str, int, list[dict]]]:
    """[(kind, rows, example rows)] of the most frequent error kinds, a few rows each (id,
    sample_index, error, and error_kind where the parts have it: input or generation);
    reads the error rows' few columns, a batch at a time."""
    dataset = _dataset(output)
    if dataset is None:
        return []
    counts: Counter[str] = Counter()
    examples: dict[str, list[dict]] = defaultdict(list)
    columns = ["id", "sample_index", "error"]
    if "error_kind" in dataset.schema.names:
        columns.append("error_kind")
    for batch in dataset.to_batches(columns=columns, filter=pc.field("error").is_valid()):
        for row in batch.to_pylist():
            kind = error_kind(row["error"])
            counts[kind] += 1
            if len(examples[kind]) < EXAMPLES:
                examples[kind].append(row)
    return [(kind, n, examples[kind]) for kind, n in counts.most_common(KINDS)]


# -- plots ------------------------------------------------------------------------------------
def write_plots(
    output: OutputDir, summary: dict[str, Any], report_dir: Path, lengths: Lengths
) -> list[str]:
    """The PLOTS, as PNG files; returns their file names."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = output.read(["nfe", "accepted_steps_per_forward", "error"])
    ok = pc.is_null(table.column("error")) if table is not None else None
    nfe = _values(table, "nfe", ok)
    accepted = _values(table, "accepted_steps_per_forward", ok)

    def save(figure, name: str) -> None:
        figure.tight_layout()
        figure.savefig(report_dir / name, dpi=100)
        plt.close(figure)

    figure, axes = plt.subplots(figsize=(6, 4))
    if lengths.counts:
        values = sorted(lengths.counts)
        axes.bar(values, [lengths.counts[v] for v in values], width=1.0, color="tab:purple")
    axes.set(
        xlabel="generated tokens per completion",
        ylabel="completions",
        title="Completion lengths",
    )
    save(figure, PLOTS[0])

    figure, axes = plt.subplots(figsize=(6, 4))
    axes.hist(nfe, bins=min(40, max(1, len(np.unique(nfe)))), color="tab:blue")
    axes.set(xlabel="NFE (target forwards) per sample", ylabel="samples", title="NFE per sample")
    save(figure, PLOTS[1])

    figure, axes = plt.subplots(figsize=(6, 4))
    axes.hist(accepted, bins=40, color="tab:green")
    axes.set(
        xlabel="decoding steps advanced per target forward",
        ylabel="samples",
        title="Steps per forward (1.0 = draft-free)",
    )
    save(figure, PLOTS[2])

    figure, axes = plt.subplots(figsize=(6, 4))
    for index, run in enumerate(summary["runs"]):
        seconds, tokens = throughput(run)
        if len(seconds) > 1:
            label = f"run {index + 1} ({run_status(run)})"
            if run.get("tokens_per_second") is not None:
                label += f": {run['tokens_per_second']:,.1f} tok/s over the run"
            line = axes.step(seconds, tokens, where="post", marker="o", markersize=3, label=label)
            for phase, when in (run.get("phases") or {}).items():
                if phase in PHASE_NAMES:
                    axes.axvline(when, color=line[0].get_color(), linestyle=":", linewidth=1)
                    axes.annotate(
                        PHASE_NAMES[phase],
                        (when, 0),
                        xytext=(2, 4),
                        textcoords="offset points",
                        rotation=90,
                        fontsize=8,
                        color="#555",
                    )
    axes.set(
        xlabel="seconds since the run started",
        ylabel="generated tokens",
        title="Throughput (slope: tokens / s)",
    )
    if axes.lines:
        axes.legend()
    else:
        axes.text(0.5, 0.5, "no progress records", ha="center", transform=axes.transAxes)
    save(figure, PLOTS[3])
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


# -- the page ---------------------------------------------------------------------------------
def _cells(row: list[Any], tag: str = "td") -> str:
    return "".join(f"<{tag}>{html.escape(str(v))}</{tag}>" for v in row)


def _table(
    header: list[str], rows: list[list[Any]], classes: list[str] | None = None, kind: str = ""
) -> str:
    body = "\n".join(
        (f'<tr class="{classes[i]}">' if classes else "<tr>") + f"{_cells(r)}</tr>"
        for i, r in enumerate(rows)
    )
    opening = f'<table class="{kind}">' if kind else "<table>"
    return f"{opening}<tr>{_cells(header, 'th')}</tr>\n{body}</table>"


def _rows(count: int) -> str:
    return _count(count, "row")


def _clip(text: Any, limit: int) -> str:
    if text is None:
        return ""
    text = str(text)
    return text if len(text) <= limit else text[:limit] + " …"


def _learning_section(summary: dict[str, Any]) -> str:
    """A learning job's rounds (none for a job that did not learn)."""
    if not summary.get("drafter_learning"):
        return ""
    lines = "".join(f"<p>{html.escape(line)}</p>" for line in learning_lines(summary))
    return (
        f"<h2>Drafter learning</h2>{lines}"
        + _table(ROUND_HEADER, learning_rounds(summary))
        + "<p class=note>Rows used: train / validation / held out. Steps per forward are "
        "replayed on the held-out rows' recorded decoding, for the drafter in use before "
        "the round and for the round's drafter.</p>"
    )


def _runs_section(runs: list[dict[str, Any]]) -> str:
    rows = [
        [
            i + 1,
            r.get("started_at", "-"),
            run_status(r),
            number(r.get("wall_seconds"), 1),
            number(r.get("rows_written")),
            number(r.get("tokens_per_second"), 1),
            number(r.get("decode_tokens_per_second"), 1),
            number((r.get("batch_failures") or {}).get("count", 0)),
            run_error(r),
        ]
        for i, r in enumerate(runs)
    ]
    header = [
        "run",
        "started (UTC)",
        "status",
        "wall s",
        "rows written",
        "tok/s over the run",
        "tok/s decoding",
        "batch failures",
        "error",
    ]
    counts = Counter(run_status(r) for r in runs)
    tally = ", ".join(f"{counts[s]} {s}" for s in RUN_STATUSES if counts[s])
    return (
        f"<h2>Runs ({tally})</h2>"
        + _table(header, rows, [run_status(r) for r in runs], kind="runs")
        + "<p class=note>tok/s over the run: its generated tokens over its wall time, "
        "start-up included (the job's tokens / s is the same over all runs); tok/s "
        "decoding: from its first finished batch to its last, as its progress lines showed. "
        "A lost run ended without writing its record (killed, or its machine lost): the next "
        "run counted its rows from the parts it left.</p>"
    )


def _batch_failures_section(runs: list[dict[str, Any]]) -> str:
    failures = batch_failures(runs)
    if not failures:
        return ""
    rows = [[f"{n:,}", _clip(error, 300)] for error, n in failures.most_common(KINDS)]
    return (
        f"<h2>Batch failures ({_count(sum(failures.values()), 'batch', 'batches')})</h2>"
        + _table(["batches", "first line of the error"], rows)
        + "<p class=note>Each failure's traceback is in the run's log (logs/ beside "
        "summary.json).</p>"
    )


def _errors_section(summary: dict[str, Any], examples: list[tuple[str, int, list[dict]]]) -> str:
    if not examples:
        return "<h2>Errors</h2><p>No row failed.</p>"
    parts = []
    for kind, count, found in examples:
        items = "".join(
            f"<li>id {html.escape(str(e['id']))}, sample {e['sample_index']}"
            + (f" ({html.escape(e['error_kind'])})" if e.get("error_kind") else "")
            + f": {html.escape(_clip(e['error'], 300))}</li>"
            for e in found
        )
        parts.append(f"<h3>{html.escape(_clip(kind, 120))} ({_rows(count)})</h3><ul>{items}</ul>")
    return (
        f"<h2>Errors ({_rows(summary['totals']['errors'])})</h2>"
        "<p class=note>A kind is the error with its numbers as N; input errors are rows "
        "that cannot be generated as given, generation errors failed inside the model (a "
        "resubmit retries those).</p>" + "".join(parts)
    )


def _completions_section(summary: dict[str, Any], lengths: Lengths) -> str:
    gen_length = summary["job"]["decoding"]["gen_length"]
    reasons = finish_rows(summary)
    table = _table(["finish reason", "rows", "share"], reasons) if reasons else "<p>-</p>"
    return (
        "<h2>Completions</h2>"
        f"<p>Lengths, {html.escape(length_text(lengths, gen_length))}.</p>{table}"
        "<p class=note>eos: the model ended it; length: it reached gen_length; stop: a stop "
        "string cut it; error: no completion (see Errors).</p>"
    )


def _samples_section(output: OutputDir, lengths: Lengths) -> str:
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
        for s in sample_completions(output, lengths)
    ]
    header = ["id", "sample", "prompt", "completion", "finish", "tokens", "NFE"]
    return (
        f"<h2>Sample completions ({len(samples)}, shortest first)</h2>"
        "<p class=note>Spread over the completion lengths: the rows nearest evenly spaced "
        "percentiles of the lengths, the shortest and the longest included.</p>"
        + _table(header, samples, kind="samples")
    )


STYLE = """
body{font-family:system-ui,sans-serif;margin:2em auto;max-width:1150px;padding:0 1em;
  color:#222;line-height:1.4}
h1{margin-bottom:0.2em}
p.lead{font-size:1.12em;line-height:1.5;max-width:60em}
table{border-collapse:collapse;margin:0.5em 0}
th,td{text-align:left;padding:0.25em 0.8em;border-bottom:1px solid #ddd;vertical-align:top}
th{background:#f4f4f4}
table.summary th{background:none;font-weight:normal;color:#555}
td{white-space:pre-wrap;word-break:break-word}
td:first-child{white-space:nowrap}
table.samples{width:100%;font-size:0.92em}
table.samples td:nth-child(3),table.samples td:nth-child(4){width:38%}
table.runs td{white-space:nowrap}
table.runs td:last-child{white-space:pre-wrap;font-size:0.9em}
tr.failed td{background:#fde8e8}
tr.interrupted td{background:#fff4d6}
tr.lost td{background:#ececf6}
.alert{border-left:4px solid;padding:0.6em 1em}
.alert.failed{background:#fde8e8;border-color:#c0392b}
.alert.interrupted{background:#fff4d6;border-color:#d68910}
.alert.lost{background:#ececf6;border-color:#5b4b9e}
.note{color:#555;font-size:0.9em}
.plots{display:grid;grid-template-columns:1fr 1fr;gap:1em}
.plots img{width:100%}
"""


def write_html(
    summary: dict[str, Any],
    rows: list[tuple[str, str]],
    report_dir: Path,
    output: OutputDir,
    words: str,
    lengths: Lengths,
    classes: dict[tuple[int, int], Counter],
    examples: list[tuple[str, int, list[dict]]],
) -> Path:
    name = html.escape(summary["job"]["name"])
    runs = summary["runs"]
    sections = [f'<p class="lead">{html.escape(words)}</p>']
    last = runs[-1] if runs else None
    if last is not None and run_status(last) != "succeeded":
        status = run_status(last)
        sections.append(f'<p class="alert {status}">{html.escape(_status_sentence(last))}</p>')
    totals = "\n".join(
        f"<tr><th>{html.escape(label)}</th><td>{html.escape(value)}</td></tr>"
        for label, value in rows
    )
    sections.append(f'<h2>Summary</h2><table class="summary">{totals}</table>')
    if speculation(summary) is not None:
        sections.append(
            "<p class=note>Draft-free decoding takes one target forward per decoding step, so "
            "its NFE is the steps taken. Its cost is this job's cost scaled by steps / NFE: "
            "an upper bound of the saving, since draft-free forwards are narrower and run no "
            "drafter. Tokens / s is generated tokens over the runs' wall time, start-up "
            "included.</p>"
        )
    sections.append(_completions_section(summary, lengths))
    budgets = budget_lines(summary, classes)
    sections.append(
        "<h2>Tree budget</h2><ul>"
        + "".join(f"<li>{html.escape(line)}</li>" for line in budgets)
        + "</ul>"
    )
    sections.append(_learning_section(summary))
    sections.append(_runs_section(runs))
    sections.append(_batch_failures_section(runs))
    sections.append(_errors_section(summary, examples))
    sections.append(_samples_section(output, lengths))
    images = "\n".join(f'<img src="{plot}" alt="{plot}">' for plot in PLOTS)
    sections.append(
        f'<h2>Plots</h2><div class="plots">{images}</div><p class=note>Throughput comes from '
        "the progress records each run kept as it went; its legend gives the run's tokens/s "
        "over its whole wall time, start-up included.</p>"
    )
    versions = ", ".join(f"{k} {v}" for k, v in summary["versions"].items())
    page = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>{name}</title>
<style>{STYLE}</style></head>
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
    classes = budget_classes(output)
    lengths = completion_lengths(output)
    examples = error_examples(output)
    words = report_words(summary, classes, lengths, examples)
    write_plots(output, summary, report_dir, lengths)
    lead = report_words(summary, classes, lengths, examples, last_status=False)
    write_html(summary, rows, report_dir, output, lead, lengths, classes, examples)
    gen_length = summary["job"]["decoding"]["gen_length"]
    lines = [words, "", format_table(rows), "completions:"]
    lines.append(f"  lengths {length_text(lengths, gen_length)}")
    lines += [f"  {reason}: {n} ({share})" for reason, n, share in finish_rows(summary)]
    lines.append("tree budget:")
    lines += [f"  {line}" for line in budget_lines(summary, classes)]
    if summary.get("drafter_learning"):
        lines.append("drafter learning:")
        lines += [f"  {line}" for line in learning_lines(summary)]
        lines += [
            f"  {r[0]}. {r[1]}, {r[2]} rows: {r[3]}; {r[4]} s, adopted {r[5]}"
            for r in learning_rounds(summary)
        ]
    lines.append("runs:")
    for i, run in enumerate(summary["runs"]):
        error = f": {run_error(run)}" if run.get("error") else ""
        lines.append(
            f"  {i + 1}. {run.get('started_at', '-')} {run_status(run)}, "
            f"{number(run.get('rows_written'))} rows in {number(run.get('wall_seconds'), 1)} s"
            f"{error}"
        )
    failures = batch_failures(summary["runs"])
    if failures:
        lines.append("batch failures (first line of the error):")
        lines += [f"  {n:,}  {_clip(error, 100)}" for error, n in failures.most_common(KINDS)]
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
