"""Full batches across replica calls, measured through the real CLI and its embedded Ray:
`spot-pipeline submit` of the bundled held-out prompts, one replica, draft-free, and the
requests per target forward the summary reports (`totals.requests_per_forward`; a full batch
is the batch size), with the time spent computing prompts (`totals.prefill_share`).

    .venv/bin/python bench/pipeline_batches.py --rows 64 2000

Jobs of more rows than the 400 held-out prompts take several samples of each, at T=0.8 (a
job of 2,000 rows: 400 prompts x 5 samples). With `--system-prompt long`, every row has the
~300-token system prompt of bench/prefix_cache.py in front of it; `--prefix-cache auto 0`
runs each job with the replica's prefix cache and without, and checks that both write the
same tokens. `--gpu` gives the replica a GPU (resources.num_gpus: 1).
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.prefix_cache import SYSTEM_PROMPTS  # noqa: E402

HELD_OUT = 400  # prompts in builtin:prompts/heldout.jsonl


def job(args, rows: int, cache: str, out: Path) -> dict:
    limit = min(rows, HELD_OUT)
    samples = math.ceil(rows / limit)
    system = SYSTEM_PROMPTS.get(args.system_prompt)
    return {
        "name": f"batches-{rows}",
        "input": {
            "path": "builtin:prompts/heldout.jsonl",
            "limit": limit,
            **({"system_prompt": system} if system else {}),
        },
        "model": {"path": f"builtin:{args.target}", "dtype": "float32"},
        "decoding": {
            "gen_length": args.gen_length,
            "block_length": args.block_length,
            "temperature": 0.8 if samples > 1 else 0.0,
            "samples_per_prompt": samples,
            "seed": 0,
        },
        "resources": {
            "replicas": 1,
            "batch_size": args.batch_size,
            "num_cpus": 1,
            "num_gpus": 1 if args.gpu else 0,
            "prefix_cache_bytes": cache if cache == "auto" else int(cache),
        },
        "output": {"path": str(out)},
    }


def submit_file(path: Path) -> float:
    """`spot-pipeline submit PATH --overwrite` in a subprocess from the checkout; its wall
    time, launch to exit. A failure ends the benchmark with the command's last output."""
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "submit", str(path), "--overwrite"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(
            f"submit {path} failed ({done.returncode}):\n{done.stdout[-3000:]}\n"
            f"{done.stderr[-3000:]}"
        )
    return seconds


def submit(spec: dict, folder: Path) -> tuple[dict, float, dict]:
    """The job's summary, the command's wall time and its rows' tokens by key."""
    path = folder / f"{spec['name']}.yaml"
    path.write_text(yaml.safe_dump(spec))
    seconds = submit_file(path)
    out = Path(spec["output"]["path"])
    table = pq.read_table(out / "data", columns=["id", "sample_index", "completion_token_ids"])
    tokens = {(r["id"], r["sample_index"]): r["completion_token_ids"] for r in table.to_pylist()}
    return json.loads((out / "summary.json").read_text()), seconds, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 2000])
    parser.add_argument("--target", default="sdar-nano")
    parser.add_argument("--gen-length", type=int, default=32)
    parser.add_argument("--block-length", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--system-prompt", choices=["none", *SYSTEM_PROMPTS], default="none")
    parser.add_argument("--prefix-cache", nargs="+", default=["auto"])
    parser.add_argument("--gpu", action="store_true")
    args = parser.parse_args()
    print(
        f"{args.target}, gen {args.gen_length}, block {args.block_length}, batch "
        f"{args.batch_size}, draft-free, one replica{' on a GPU' if args.gpu else ''}, "
        f"system prompt {args.system_prompt}"
    )
    columns = ["rows", "prefix cache", "requests per forward", "prefill share", "tok/s"]
    columns += ["wall s", "same tokens"]
    print(f"| {' | '.join(columns)} |")
    print("|---" * len(columns) + "|")
    with tempfile.TemporaryDirectory(prefix="batches-") as scratch:
        folder = Path(scratch)
        for rows in args.rows:
            first = None
            for cache in args.prefix_cache:
                spec = job(args, rows, cache, folder / f"out-{rows}-{cache}")
                summary, seconds, tokens = submit(spec, folder)
                first = tokens if first is None else first
                totals, run = summary["totals"], summary["runs"][-1]
                share = totals.get("prefill_share")
                print(
                    f"| {totals['rows']} | {cache} | {totals['requests_per_forward']:.2f} | "
                    f"{'-' if share is None else f'{share:.1%}'} | "
                    f"{run['tokens_per_second']:.1f} | {seconds:.0f} | {tokens == first} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
