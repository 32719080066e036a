"""summary.json: the resolved job, versions, and totals over everything the output holds.

Totals are computed from the part files themselves, so a resumed job's summary covers all
its runs; `runs` keeps each run's wall time and progress samples (tokens/s over time).
"""

from __future__ import annotations

import importlib.metadata
import platform
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline.job import Job

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


def _column(table: pa.Table, name: str, ok: pa.Array) -> np.ndarray:
    return pc.filter(table.column(name), ok).to_numpy(zero_copy_only=False).astype(np.float64)


def totals(table: pa.Table | None) -> dict[str, Any]:
    """Row, error, token and NFE totals of the output rows."""
    if table is None or table.num_rows == 0:
        return {"rows": 0, "errors": 0, "generated_tokens": 0}
    ok = pc.is_null(table.column("error"))
    nfe = _column(table, "nfe", ok)
    steps = _column(table, "steps", ok)
    tokens = _column(table, "num_generated_tokens", ok)
    accepted = _column(table, "accepted_steps_per_forward", ok)
    reasons = pc.value_counts(table.column("finish_reason")).to_pylist()
    errors = pc.drop_null(table.column("error"))
    error_kinds = pc.value_counts(pc.utf8_slice_codeunits(errors, 0, 40)).to_pylist()
    out: dict[str, Any] = {
        "rows": table.num_rows,
        "errors": len(errors),
        "generated_tokens": int(tokens.sum()),
        "prompt_tokens": int(_column(table, "num_prompt_tokens", ok).sum()),
        "finish_reasons": {r["values"]: r["counts"] for r in reasons},
        "error_kinds": {r["values"]: r["counts"] for r in error_kinds},
    }
    if nfe.size:
        out.update(
            {
                "nfe_mean": float(nfe.mean()),
                "nfe_p50": float(np.percentile(nfe, 50)),
                "nfe_p95": float(np.percentile(nfe, 95)),
                "nfe_total": int(nfe.sum()),
                "steps_per_nfe": float(steps.sum() / nfe.sum()),
                "accepted_steps_per_forward_mean": float(accepted.mean()),
                "generated_tokens_per_nfe": float(tokens.sum() / nfe.sum()),
            }
        )
    return out


def build_summary(job: Job, table: pa.Table | None, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The whole summary; `runs` are this output's runs, the newest last."""
    counted = totals(table)
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
    }
