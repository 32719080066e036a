"""`spot-pipeline estimate` against the run it projects: the projected wall time of a job,
then the job itself, each a `spot-pipeline` command in a subprocess, on the same machine.

    .venv/bin/python bench/estimate_accuracy.py
    .venv/bin/python bench/estimate_accuracy.py --job jobs/synthetic.yaml --case 400=input.limit=400

Each --case is JOB_FILE:NAME=KEY=VALUE[;KEY=VALUE] job overrides (`--set`); {rows-2000} in
a value is a Parquet file of 2,000 rows written for the run. The default cases: the
quick-start job (jobs/synthetic.yaml: sdar-tiny, threshold 0.7, 64 tokens) on the 400 bundled
held-out prompts and on 2,000 rows (those prompts cycled five times under distinct ids: at
T=0 the work of 400 prompts x 5 samples, which a job now refuses as identical samples), and
the same row counts with the fast target of bench/pipeline_scale.py (sdar-nano, draft-free,
16 tokens), where the pipeline's fixed start is most of the run. The projection is the
configured line of `estimate --json` (`configured.wall_seconds`, its start measured by the
estimate on this machine); the measured wall time runs from launching `submit` to its exit,
into a fresh output folder. Output folders are deleted at the end.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.driver_memory import DriverRun, run_driver  # noqa: E402

SYNTHETIC = "jobs/synthetic.yaml"
FAST = (
    "model.path=builtin:sdar-nano;drafter.kind=none;decoding.gen_length=16;decoding.block_length=16"
)
ROWS_2000 = "input.path={rows-2000};input.limit=null"
DEFAULT_CASES = [
    f"{SYNTHETIC}:400=input.limit=400",
    f"{SYNTHETIC}:2000={ROWS_2000}",
    f"{SYNTHETIC}:fast-400=input.limit=400;{FAST}",
    f"{SYNTHETIC}:fast-2000={ROWS_2000};{FAST}",
]


def spot_pipeline(args: list[str]) -> DriverRun:
    """One `spot-pipeline` command from this checkout, in a subprocess; stops on failure."""
    run = run_driver(args)
    if run.returncode != 0:
        sys.exit(f"{' '.join(args)} failed ({run.returncode}):\n{run.output[-4000:]}")
    return run


def write_rows(path: Path, rows: int) -> Path:
    """`rows` rows cycling the bundled held-out prompts, ids p0..p<rows-1>."""
    from bench.pipeline_scale import write_input

    return path if path.exists() else write_input(path, rows)


def run_case(case: str, work: Path) -> dict:
    """Estimate, then submit, the job a case names."""
    job_file, rest = case.split(":", 1)
    name, overrides = rest.split("=", 1)
    if "{rows-2000}" in overrides:
        overrides = overrides.replace(
            "{rows-2000}", str(write_rows(work / "rows-2000.parquet", 2000))
        )
    output = work / name
    sets = [item for item in overrides.split(";") if item] + [f"output.path={output}"]
    flags = [flag for item in sets for flag in ("--set", item)]
    estimated = spot_pipeline(["estimate", job_file, "--json", *flags])
    estimate_seconds = estimated.seconds
    projection = json.loads(estimated.stdout)
    measured = spot_pipeline(["submit", job_file, *flags]).seconds
    summary = json.loads((output / "summary.json").read_text())
    projected = projection["configured"]["wall_seconds"]
    result = {
        "case": name,
        "job": job_file,
        "overrides": sets[:-1],
        "rows": summary["totals"]["rows"],
        "estimate_seconds": estimate_seconds,
        "sample_rows": projection["sample"]["rows"],
        "start": projection["start"],
        "projected_seconds": projected,
        "measured_seconds": measured,
        "error": projected / measured - 1,
    }
    start = ", ".join(f"{k} {v:.1f}" for k, v in projection["start"].items())
    print(
        f"{name}: {result['rows']} rows, projected {projected:.1f} s, measured {measured:.1f} s "
        f"({result['error']:+.1%}; the estimate took {estimate_seconds:.1f} s; its start: "
        f"{start} s)",
        flush=True,
    )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--case",
        action="append",
        help="JOB_FILE:NAME=KEY=VALUE[;KEY=VALUE] (repeatable; default: four cases, see above)",
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="estimate-accuracy-", dir="/tmp"))
    try:
        results = [run_case(case, work) for case in args.case or DEFAULT_CASES]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"\n{'case':<10}  {'rows':>6}  {'projected':>10}  {'measured':>9}  {'error':>7}")
    for r in results:
        print(
            f"{r['case']:<10}  {r['rows']:>6}  {r['projected_seconds']:>9.1f}s  "
            f"{r['measured_seconds']:>8.1f}s  {r['error']:>+7.1%}"
        )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
