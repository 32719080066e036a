"""summary.json: the resolved job, versions, and totals over everything the output holds.

Totals are computed from the part files themselves, so a resumed job's summary covers all
its runs; `runs` keeps each run's wall time and progress samples (tokens/s over time). They
stream through a few numeric and short columns of the parts, so the driver's memory does not
grow with the corpus. A run that ended without writing its record (its marker left in
`runs/`, pipeline.lease) is recorded by the next submit as `lost`, with the rows and tokens
of the parts it wrote (their metadata names it) and its time until its last heartbeat, so
rows, tokens and cost add up.
"""

from __future__ import annotations

import importlib.metadata
import math
import platform
import subprocess
import sys
import tomllib
from collections import Counter
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs

from pipeline.job import Job
from pipeline.lease import read_markers, remove_marker
from pipeline.output import OutputDir, part_run

_LIBRARIES = (
    "spot-pipeline",
    "torch",
    "transformers",
    "tokenizers",
    "ray",
    "pyarrow",
    "pydantic",
    "deepspeed",
)


def versions() -> dict[str, str]:
    """Python, platform, the package (its source commit when run from a checkout) and the
    libraries that decide the numbers."""
    found = {"python": sys.version.split()[0], "platform": platform.platform()}
    for name in _LIBRARIES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = "not installed"
    if found["spot-pipeline"] == "not installed":
        found["spot-pipeline"] = _source_version()
    commit = _source_commit()
    if commit:
        found["spot-pipeline commit"] = commit
    return found


def _source_version() -> str:
    pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
    if not pyproject.is_file():
        return "unknown"
    return tomllib.loads(pyproject.read_text())["project"]["version"] + " (source)"


def _source_commit() -> str | None:
    """The checkout's commit, '+modified' when its tracked files differ; None outside git."""
    root = Path(__file__).resolve().parents[1]
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if commit.returncode != 0:
        return None
    return commit.stdout.strip() + ("+modified" if dirty.stdout.strip() else "")


COUNTED = [
    "error",
    "finish_reason",
    "num_prompt_tokens",
    "num_generated_tokens",
    "nfe",
    "steps",
    "accepted_steps_per_forward",
    "forward_share",
    "wall_seconds",
    "prompt_tokens_reused",
    "prompt_tokens_computed",
    "prefill_seconds",
    "error_kind",
]
"""The output columns the totals read: never the prompts, completions or token ids (a part
written before a column existed reads without it)."""


@dataclass
class Totals:
    """Row, error, token and NFE totals of output rows, added a batch at a time from the
    COUNTED columns. Memory does not grow with the rows: NFE, an integer, is kept as a
    histogram of its values, from which its percentiles are exact."""

    rows: int = 0
    errors: int = 0
    generated_tokens: int = 0
    prompt_tokens: int = 0
    steps: int = 0
    accepted_sum: float = 0.0
    forwards: float = 0.0  # sum of forward_share: the target forwards the rows took part in
    shared_nfe: int = 0  # NFE of the rows that have a forward_share
    nfe: Counter[int] = field(default_factory=Counter)
    finish_reasons: Counter[str] = field(default_factory=Counter)
    error_kinds: Counter[str] = field(default_factory=Counter)
    errors_by_kind: Counter[str] = field(default_factory=Counter)  # input / generation
    prompt_tokens_reused: int = 0
    prompt_tokens_computed: int = 0
    prefill_seconds: float = 0.0
    # the replicas' decoding time: each row's wall time over the requests it shared its
    # forwards with (nfe / forward_share), summed
    decode_seconds: float = 0.0

    def add(self, batch: pa.RecordBatch | pa.Table) -> None:
        """Count the rows of `batch` (it needs the COUNTED columns only)."""
        errors = batch.column("error")
        ok = pc.is_null(errors)
        generated = batch.filter(ok)
        self.rows += batch.num_rows
        self.errors += batch.num_rows - generated.num_rows
        self.generated_tokens += _sum(generated.column("num_generated_tokens"))
        self.prompt_tokens += _sum(generated.column("num_prompt_tokens"))
        self.steps += _sum(generated.column("steps"))
        self.accepted_sum += _sum(generated.column("accepted_steps_per_forward"))
        if "forward_share" in generated.column_names:
            shared = generated.filter(pc.is_valid(generated.column("forward_share")))
            self.forwards += _sum(shared.column("forward_share"))
            self.shared_nfe += _sum(shared.column("nfe"))
        self.nfe.update(_value_counts(pc.drop_null(generated.column("nfe"))))
        self.finish_reasons.update(_value_counts(batch.column("finish_reason")))
        kinds = pc.utf8_slice_codeunits(pc.drop_null(errors), 0, 40)
        self.error_kinds.update(_value_counts(kinds))
        if "error_kind" in batch.column_names:  # parts written before it: not counted
            self.errors_by_kind.update(_value_counts(pc.drop_null(batch.column("error_kind"))))
        if "prefill_seconds" in generated.column_names:  # parts written before it: not counted
            self.prompt_tokens_reused += _sum(generated.column("prompt_tokens_reused"))
            self.prompt_tokens_computed += _sum(generated.column("prompt_tokens_computed"))
            self.prefill_seconds += _sum(generated.column("prefill_seconds"))
            shared = generated.filter(pc.greater(generated.column("nfe"), 0))
            busy = pc.divide(
                pc.multiply(shared.column("wall_seconds"), shared.column("forward_share")),
                pc.cast(shared.column("nfe"), pa.float64()),
            )
            self.decode_seconds += _sum(busy)

    def as_dict(self) -> dict[str, Any]:
        """The summary's `totals`."""
        if self.rows == 0:
            return {"rows": 0, "errors": 0, "generated_tokens": 0}
        out: dict[str, Any] = {
            "rows": self.rows,
            "errors": self.errors,
            "generated_tokens": self.generated_tokens,
            "prompt_tokens": self.prompt_tokens,
            "finish_reasons": dict(self.finish_reasons),
            "error_kinds": dict(self.error_kinds),
        }
        generated = self.nfe.total()
        nfe_total = sum(value * count for value, count in self.nfe.items())
        if generated:
            out.update(
                {
                    "nfe_mean": nfe_total / generated,
                    "nfe_p50": histogram_percentile(self.nfe, 50),
                    "nfe_p95": histogram_percentile(self.nfe, 95),
                    "nfe_total": nfe_total,
                    "steps_per_nfe": self.steps / nfe_total,
                    "accepted_steps_per_forward_mean": self.accepted_sum / generated,
                    "generated_tokens_per_nfe": self.generated_tokens / nfe_total,
                }
            )
        if self.forwards:  # mean requests in a target forward
            out["requests_per_forward"] = self.shared_nfe / self.forwards
        if self.errors_by_kind:
            out["errors_by_kind"] = dict(self.errors_by_kind)
        if self.prompt_tokens_reused or self.prompt_tokens_computed:
            out.update(
                {
                    "prompt_tokens_reused": self.prompt_tokens_reused,
                    "prompt_tokens_computed": self.prompt_tokens_computed,
                    "prefill_seconds": self.prefill_seconds,
                }
            )
            if self.decode_seconds:  # the share of the replicas' decoding time
                out["prefill_share"] = min(1.0, self.prefill_seconds / self.decode_seconds)
        return out


def _sum(column: pa.Array | pa.ChunkedArray) -> Any:
    return pc.sum(column).as_py() or 0


def _value_counts(column: pa.Array | pa.ChunkedArray) -> dict[Any, int]:
    counts = pc.value_counts(column)
    return dict(zip(counts.field("values").to_pylist(), counts.field("counts").to_pylist()))


def histogram_percentile(counts: Counter[int], q: float) -> float:
    """`np.percentile(values, q)` (linear interpolation) of the values that `counts` holds."""
    ordered = sorted(counts)
    values = np.array(ordered, dtype=np.float64)
    ends = np.cumsum([counts[v] for v in ordered])  # rank after each value's last copy
    position = q / 100 * (ends[-1] - 1)
    below = math.floor(position)
    a, b = values[np.searchsorted(ends, [below + 1, min(below + 2, ends[-1])])]
    fraction = position - below
    if fraction >= 0.5:  # numpy's lerp, the same on both sides of the halfway point
        return float(b - (b - a) * (1 - fraction))
    return float(a + (b - a) * fraction)


def output_totals(output: OutputDir, new: Collection[str] = ()) -> tuple[dict, dict]:
    """Totals over every part of `output`, and over its parts in `new` (one run's)."""
    new_files = set(new)
    everything, this_run = Totals(), Totals()
    old = [path for path in output.part_files() if path not in new_files]
    for batch in output.batches(COUNTED, old):
        everything.add(batch)
    for batch in output.batches(COUNTED, sorted(new_files)):
        everything.add(batch)
        this_run.add(batch)
    return everything.as_dict(), this_run.as_dict()


def build_summary(job: Job, counted: dict[str, Any], runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The whole summary from the output's totals (`output_totals`); `runs` are this
    output's runs, the newest last."""
    wall = sum(r["wall_seconds"] for r in runs)
    replica_hours = sum(r["wall_seconds"] * r["replicas"] for r in runs) / 3600.0
    cost = replica_hours * job.cost.replica_hour_price(job.resources.num_gpus)
    tokens = counted["generated_tokens"]
    return {
        "job": job.model_dump(mode="json"),
        "versions": versions(),
        "totals": counted,
        "wall_seconds": wall,
        "replica_hours": replica_hours,
        "gpu_hours": replica_hours * job.resources.num_gpus,
        "tokens_per_second": tokens / wall if wall > 0 else None,
        "cost_usd": cost,
        "usd_per_million_tokens": cost / tokens * 1e6 if tokens else None,
        "runs": runs,
    } | _drafter_learning(runs)


def _drafter_learning(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """A learning job's rounds, every run's (the newest run that learned holds them all:
    each run starts from the rounds before it, pipeline.learning)."""
    learned = [run["drafter_learning"] for run in runs if run.get("drafter_learning")]
    return {"drafter_learning": learned[-1]} if learned else {}


LOST = (
    "ended without writing its record (killed, its machine lost, or its disk full); "
    "counted from the parts it wrote"
)
CLOCK_SLACK_SECONDS = 60  # parts older than a run's start by more than this are not its own


def lost_run_record(output: OutputDir, marker: dict[str, Any]) -> dict[str, Any]:
    """The record of the run that left `marker` and no record: what its parts hold, its
    wall time until its last heartbeat (or its last part, if later)."""
    started = datetime.fromisoformat(marker["started_at"]).timestamp()
    infos = [i for i in _part_infos(output) if i.mtime_ns / 1e9 >= started - CLOCK_SLACK_SECONDS]
    files = [i.path for i in infos if part_run(output, i.path) == marker["run_id"]]
    totals = Totals()
    for batch in output.batches(COUNTED, files):
        totals.add(batch)
    ended = max(
        [marker.get("last_seen", started), *(i.mtime_ns / 1e9 for i in infos if i.path in files)]
    )
    wall = max(0.0, ended - started)
    return {
        "status": "lost",
        "error": LOST,
        "started_at": marker["started_at"],
        "wall_seconds": wall,
        "replicas": marker.get("replicas", 1),
        "rows_written": totals.rows,
        "rows_retried": marker.get("rows_retried", 0),
        "generated_tokens": totals.generated_tokens,
        "tokens_per_second": totals.generated_tokens / wall if wall > 0 else None,
        "progress": [],
        "batch_failures": None,  # what its replicas counted died with it
        "prefill_seconds": None,
        "run_id": marker["run_id"],
    }


def _part_infos(output: OutputDir) -> list[pafs.FileInfo]:
    paths = output.part_files()
    return output.filesystem.get_file_info(paths) if paths else []


def record_lost_runs(
    output: OutputDir, job: Job, current_run: str, echo: Callable[[str], None]
) -> list[dict[str, Any]]:
    """Record every run whose marker outlived it (all but `current_run`'s, whose submit
    holds the lease now) in summary.json as `lost`, then remove their markers; returns the
    records added."""
    markers = [m for m in read_markers(output) if m.get("run_id") != current_run]
    if not markers:
        return []
    summary = output.read_summary() or {}
    runs = summary.get("runs", [])
    recorded = {run.get("run_id") for run in runs}
    lost = [lost_run_record(output, m) for m in markers if m["run_id"] not in recorded]
    if lost:
        counted, _ = output_totals(output)
        runs = sorted([*runs, *lost], key=lambda run: run.get("started_at", ""))
        output.write_summary(build_summary(job, counted, runs))
    for record in lost:
        echo(
            f"[{job.name}] run {record['run_id']} (started {record['started_at']}) "
            f"ended without its record: recorded as lost, {record['rows_written']} rows and "
            f"{record['generated_tokens']} tokens in {record['wall_seconds']:.0f} s"
        )
    for marker in markers:
        remove_marker(output, marker["run_id"])
    return lost
