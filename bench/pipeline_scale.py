"""Pipeline overhead: the full Ray pipeline against its own engine in one process, same rows.

    .venv/bin/python bench/pipeline_scale.py --rows 5000 10000 20000

The input cycles the bundled held-out prompts under distinct ids. The job: builtin sdar-nano,
draft-free, short generations (--gen-length 16, --block-length 16), one replica of one CPU,
batches of 8. At each size, `spot-pipeline submit` runs in a subprocess into a fresh output,
once per --variant (wall time from launch to exit: imports, Ray start, the replica's model
load, generation, writes and the summary), reporting the driver's peak RSS (see
bench/driver_memory.py). Just before and just after, the engine alone
(`pipeline.estimate.measure`: the `Engine` built in this process, torch threads as the
replica's) generates --engine-rows of the same rows (a seeded sample) in blocks of the
pipeline's size (its rate excludes its model load), so a slow spell of this shared machine
falls on both.

Printed: rows/s of each, their ratio at each size, and the line fitted to the pipeline's
wall times: wall = start + model load + rows / (rate share x the engine's rows/s): what the
pipeline adds to its engine (`spot-pipeline estimate` measures a run's start where it runs
instead, by running the pipeline on a sample).
Results also go to --json. The output folders are deleted at the end.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.driver_memory import run_driver  # noqa: E402
from pipeline.job import parse_job  # noqa: E402


def job_dict(args: argparse.Namespace, input_path: Path, output_path: Path) -> dict:
    return {
        "name": "pipeline-scale",
        "input": {"path": str(input_path), "chat_template": True},
        "model": {"path": f"builtin:{args.target}", "dtype": "float32"},
        "drafter": {"kind": "none"},
        "decoding": {
            "gen_length": args.gen_length,
            "block_length": args.block_length,
            "tokens_per_step": args.tokens_per_step,
            "temperature": 0.0,
            "seed": 0,
        },
        "resources": {"replicas": 1, "batch_size": args.batch_size, "num_cpus": 1},
        "output": {"path": str(output_path)},
    }


def write_input(path: Path, rows: int) -> Path:
    """`rows` prompts cycling the bundled held-out set, ids p0..p<rows-1>."""
    lines = (ROOT / "spot/builtin/prompts/heldout.jsonl").read_text().splitlines()
    prompts = [json.loads(line)["prompt"] for line in lines]
    chosen = [prompts[i % len(prompts)] for i in range(rows)]
    pq.write_table(pa.table({"id": [f"p{i}" for i in range(rows)], "prompt": chosen}), path)
    return path


def engine_alone(job_file: Path, limit: int | None = None) -> dict:
    """The job's engine generating `limit` of its input rows (all: None) in this process, in
    the pipeline's blocks, sampled and measured as `spot-pipeline estimate` samples and
    measures them; rows/s of generation (model load excluded)."""
    from pipeline.estimate import measure, sample_rows
    from pipeline.job import load_job
    from pipeline.stages import rows_per_block

    job = load_job(job_file)
    rows, input_rows = sample_rows(job, limit or 1 << 62)
    measured = measure(job, rows, rows_per_block(input_rows, job))
    return {
        "rows": measured.sample_rows,
        "errors": measured.errors,
        "startup_seconds": measured.rates.startup_seconds,
        "seconds": measured.generate_seconds,
        "rows_per_second": measured.sample_rows / measured.generate_seconds,
    }


def pipeline_run(job_file: Path, rows: int, variant: str) -> dict:
    """`spot-pipeline submit` into a fresh output, with the variant's environment."""
    output = Path(yaml.safe_load(job_file.read_text())["output"]["path"])
    shutil.rmtree(output, ignore_errors=True)
    env = dict(item.split("=", 1) for item in variant.split(",") if item)
    run = run_driver(["submit", str(job_file), "--progress-interval", "30"], env=env)
    if run.returncode != 0:
        sys.exit(f"submit failed (exit {run.returncode}):\n{run.output[-4000:]}")
    summary = json.loads((output / "summary.json").read_text())
    assert summary["totals"]["rows"] == rows, summary["totals"]
    return {
        "variant": variant or "as it is",
        "rows": rows,
        "errors": summary["totals"]["errors"],
        "seconds": run.seconds,
        "run_seconds": summary["wall_seconds"],
        "rows_per_second": rows / run.seconds,
        "driver_peak_rss_bytes": run.peak_rss_bytes,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[5000, 10000, 20000])
    parser.add_argument("--target", default="sdar-nano")
    parser.add_argument("--gen-length", type=int, default=16)
    parser.add_argument("--block-length", type=int, default=16)
    parser.add_argument("--tokens-per-step", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument(
        "--variant",
        action="append",
        help="KEY=VALUE[,KEY=VALUE]: the driver's environment for one variant of the pipeline "
        "(repeatable, e.g. PYTHONPATH=<another checkout>); default: one, as it is",
    )
    parser.add_argument(
        "--engine-rows",
        type=int,
        default=2000,
        help="rows the engine alone generates before and after the pipeline runs of each size "
        "(0: all of them)",
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args()
    sizes = sorted(args.rows)
    variants = args.variant or [""]
    work = Path(tempfile.mkdtemp(prefix="pipeline-scale-", dir="/tmp"))
    engines, runs = [], []
    try:
        for rows in sizes:  # the engine, then each variant, on the same rows
            input_path = write_input(work / f"input-{rows}.parquet", rows)
            job = job_dict(args, input_path, work / f"out-{rows}")
            parse_job(job)
            job_file = work / f"job-{rows}.yaml"
            job_file.write_text(yaml.safe_dump(job))
            before = engine_alone(job_file, args.engine_rows or None)
            size_runs = [pipeline_run(job_file, rows, variant) for variant in variants]
            after = engine_alone(job_file, args.engine_rows or None)
            engine = {
                "rows": rows,
                "engine_rows": before["rows"] + after["rows"],
                "seconds": before["seconds"] + after["seconds"],
                "rows_per_second": (before["rows"] + after["rows"])
                / (before["seconds"] + after["seconds"]),
                "startup_seconds": (before["startup_seconds"] + after["startup_seconds"]) / 2,
                "before_and_after": [before["rows_per_second"], after["rows_per_second"]],
            }
            engines.append(engine)
            print(
                f"engine alone beside {rows}: {engine['rows_per_second']:.2f} rows/s "
                f"(before {before['rows_per_second']:.2f}, after {after['rows_per_second']:.2f}; "
                f"model load {engine['startup_seconds']:.1f} s)",
                flush=True,
            )
            for run in size_runs:
                run["vs_engine"] = run["rows_per_second"] / engine["rows_per_second"]
                runs.append(run)
                print(
                    f"pipeline {rows} ({run['variant']}): {run['seconds']:.1f} s = "
                    f"{run['rows_per_second']:.2f} rows/s ({run['vs_engine']:.3f}x the engine), "
                    f"driver peak {run['driver_peak_rss_bytes'] / 2**20:,.0f} MiB",
                    flush=True,
                )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report = {"job": job_dict(args, Path("input"), Path("out")), "engine": engines, "runs": runs}
    print(
        f"\n{'rows':>7}  {'engine r/s':>10}  {'wall s':>8}  {'rows/s':>8}  {'vs engine':>9}  "
        f"{'driver MiB':>10}  variant"
    )
    by_size = {engine["rows"]: engine for engine in engines}
    for run in runs:
        print(
            f"{run['rows']:>7}  {by_size[run['rows']]['rows_per_second']:>10.2f}  "
            f"{run['seconds']:>8.1f}  {run['rows_per_second']:>8.2f}  {run['vs_engine']:>9.3f}  "
            f"{run['driver_peak_rss_bytes'] / 2**20:>10,.0f}  {run['variant']}"
        )
    engine_rate = sum(e["engine_rows"] for e in engines) / sum(e["seconds"] for e in engines)
    startup = sum(e["startup_seconds"] for e in engines) / len(engines)
    print(f"engine alone, all sizes: {engine_rate:.2f} rows/s, model load {startup:.1f} s")
    report["fits"] = {}
    for variant in dict.fromkeys(run["variant"] for run in runs):
        mine = [run for run in runs if run["variant"] == variant]
        if len(mine) < 2:
            continue
        # wall = start + model load + rows / (share x the engine's rate),
        # the engine's rate as measured beside each size
        engine_seconds = [r["rows"] / by_size[r["rows"]]["rows_per_second"] for r in mine]
        besides_load = [r["seconds"] - by_size[r["rows"]]["startup_seconds"] for r in mine]
        # weighted by 1/wall: the line that keeps every size's relative error small, as a
        # projection is judged (plain least squares would fit the longest runs' seconds)
        weights = 1 / np.array(besides_load)
        slope, start = np.polyfit(engine_seconds, besides_load, 1, w=weights)
        report["fits"][variant] = {"start_seconds": start, "rate_share": 1 / slope}
        print(
            f"{variant}: pipeline wall = {start:.1f} s + model load + rows / "
            f"({1 / slope:.3f} x the engine's rows/s)"
        )
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
