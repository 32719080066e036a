"""A job that learns its drafter, against draft-free and a drafter made before the job, through
the real CLI on the same off-corpus prompts.

    .venv/bin/python bench/learning_job.py --rows 400 --small          # a few minutes on a CPU
    .venv/bin/python bench/learning_job.py --rows 10000 --replicas 4   # the learner's defaults

The prompts are the first --rows of bench/offcorpus_prompts.py's stream (seed 34, unlike the
bundled corpus). Each --variant is one `spot-pipeline submit` in a subprocess into a fresh
output folder, in turn: `draft-free`, `bundled` (the target's bundled SPOT drafter, when it
has one), `learning` (drafter.learn: true from draft-free; --small shrinks the learner's
thresholds so that rounds happen within a few hundred rows, else the learner's defaults:
Spiffy at 64 rows, SPOT at 600, 1,200, 2,400, ...). A variant's wall time runs from launch
to exit (Ray start, model load, generation, learning, writes).

Printed per variant: rows, total target forwards (NFE, learning included: the learner runs
no target forward), decoding steps, steps per forward, forwards relative to draft-free, wall
seconds; for the learning job also each round (kind, rows, held-out steps per forward before
-> after at the decision budget, seconds, adopted), the replicas' seconds spent recording,
and the steps per forward of the rows that finished with the last drafter handed out (the
rows after learning). Results also go to --json. Output folders are kept under --work.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.offcorpus_prompts import offcorpus_prompts  # noqa: E402
from bench.pipeline_batches import submit_file  # noqa: E402

VARIANTS = ("draft-free", "bundled", "learning")
SMALL = {  # rounds within a few hundred rows
    "spiffy_rows": 32,
    "spot_rows": [120, 240],
    "epochs": 4,
    "replay_rows": 60,
    "heldout_percent": 15,
    "validation_percent": 15,
}


def job_dict(args: argparse.Namespace, variant: str, prompts: Path, out: Path) -> dict:
    drafter: dict = {"kind": "none"}
    if variant == "bundled":
        drafter = {"kind": "spot", "budget": args.budget}
    elif variant == "learning":
        learning = {"num_cpus": args.learner_cpus} | (SMALL if args.small else {})
        drafter = {"kind": "spot", "learn": True, "budget": args.budget, "learning": learning}
    return {
        "name": f"learning-bench-{variant}",
        "input": {"path": str(prompts)},
        "model": {"path": f"builtin:{args.target}", "dtype": "float32"},
        "drafter": drafter,
        "decoding": {
            "gen_length": args.gen_length,
            "block_length": args.block_length,
            "temperature": args.temperature,
            "seed": 0,
        },
        "resources": {
            "replicas": args.replicas,
            "batch_size": args.batch_size,
            "num_cpus": args.replica_cpus,
        },
        "output": {"path": str(out)},
    }


def run_variant(args: argparse.Namespace, variant: str, prompts: Path, work: Path) -> dict:
    out = work / variant
    job = work / f"{variant}.yaml"
    job.write_text(yaml.safe_dump(job_dict(args, variant, prompts, out)))
    wall = submit_file(job)
    summary = json.loads((out / "summary.json").read_text())
    table = pq.read_table(out / "data", columns=["id", "nfe", "steps", "drafter"])
    nfe, steps = (pc.sum(table.column(c)).as_py() for c in ("nfe", "steps"))
    result = {
        "variant": variant,
        "rows": table.num_rows,
        "nfe": nfe,
        "steps": steps,
        "steps_per_forward": steps / nfe,
        "wall_seconds": wall,
        "tokens_per_second": summary["totals"]["generated_tokens"] / wall,
    }
    learning = summary.get("drafter_learning")
    if learning:
        last = learning["current"]
        label = "none" if last is None else f"{last['kind']}:learned round {last['round']}"
        after = table.filter(pc.equal(table.column("drafter"), label))
        result |= {
            "ids_after_learning": after.column("id").to_pylist(),
            "rounds": learning["rounds"],
            "recording_seconds": learning["recording_seconds"],
            "rows_received": learning["rows_received"],
            "stopped": learning["stopped"],
            "rows_after_learning": after.num_rows,
            "steps_per_forward_after_learning": (
                pc.sum(after.column("steps")).as_py() / pc.sum(after.column("nfe")).as_py()
                if after.num_rows
                else None
            ),
        }
    return result


def recording_cost(args: argparse.Namespace, rows: list[dict], repeats: int = 3) -> dict:
    """Seconds to decode the same rows with and without the trace a learning job records
    them with (in this process, the replica's decode loop and torch threads; rounds
    interleaved so that a slow spell of the machine falls on both)."""
    import torch

    from pipeline.drafter_data import encode, load_model_and_tokenizer
    from spot.config import DecodingConfig
    from spot.decode import generate
    from spot.drafters.trajectory import TrajectoryRecorder

    torch.set_num_threads(max(1, round(args.replica_cpus)))
    tokenizer, target = load_model_and_tokenizer(f"builtin:{args.target}")
    requests = encode(tokenizer, rows)
    config = DecodingConfig(
        gen_length=args.gen_length, block_length=args.block_length, temperature=args.temperature
    )
    seconds: dict[str, list[float]] = {"plain": [], "recorded": []}
    for _ in range(repeats):
        for name in seconds:
            trace = None
            if name == "recorded":
                keys = {i: r.key for i, r in enumerate(requests)}
                trace = TrajectoryRecorder(keys, args.block_length, target.mask_id)
            start = time.perf_counter()
            generate(target, requests, config, trace=trace, max_active=args.batch_size)
            seconds[name].append(time.perf_counter() - start)
    plain, recorded = (min(seconds[n]) for n in ("plain", "recorded"))
    return {"rows": len(requests), "plain_seconds": plain, "recorded_seconds": recorded}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rows", type=int, default=400)
    p.add_argument("--target", default="sdar-nano")
    p.add_argument("--gen-length", type=int, default=64)
    p.add_argument("--block-length", type=int, default=16)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--budget", default="16", help="a number or auto")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--replicas", type=int, default=1)
    p.add_argument("--replica-cpus", type=float, default=1.0)
    p.add_argument("--learner-cpus", type=float, default=1.0)
    p.add_argument("--small", action="store_true", help="learning thresholds for short jobs")
    p.add_argument("--variant", nargs="*", choices=VARIANTS, default=list(VARIANTS))
    p.add_argument("--work", type=Path, default=None, help="folder for jobs and outputs")
    p.add_argument(
        "--recording-rows",
        type=int,
        default=64,
        help="rows decoded in this process with and without recording (0: skip)",
    )
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    args.budget = args.budget if args.budget == "auto" else int(args.budget)

    work = args.work or Path(tempfile.mkdtemp(prefix="learning-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    prompts = work / "prompts.jsonl"
    rows = offcorpus_prompts(args.rows)
    prompts.write_text(
        "".join(json.dumps({"id": r["id"], "prompt": r["prompt"]}) + "\n" for r in rows)
    )
    print(
        f"{args.rows} off-corpus prompts, builtin:{args.target}, gen {args.gen_length}, block "
        f"{args.block_length}, T={args.temperature}, budget {args.budget}, {args.replicas} "
        f"replica(s) x {args.replica_cpus:g} CPU, batch {args.batch_size}; work in {work}"
    )
    results = [run_variant(args, v, prompts, work) for v in args.variant]
    base = next((r for r in results if r["variant"] == "draft-free"), None)
    print(
        f"\n{'variant':<12} {'rows':>6} {'forwards':>9} {'steps':>9} {'steps/fwd':>9} "
        f"{'fwd ratio':>9} {'wall s':>8} {'tok/s':>8}"
    )
    for r in results:
        ratio = base["nfe"] / r["nfe"] if base else float("nan")
        print(
            f"{r['variant']:<12} {r['rows']:>6} {r['nfe']:>9} {r['steps']:>9} "
            f"{r['steps_per_forward']:>9.3f} {ratio:>8.3f}x {r['wall_seconds']:>8.1f} "
            f"{r['tokens_per_second']:>8.1f}"
        )
    tables = {r["variant"]: pq.read_table(work / r["variant"] / "data") for r in results}
    for r in results:
        if "rounds" not in r:
            continue
        for other in ("draft-free", "bundled"):  # the rows after learning, decoded otherwise
            if other in tables:
                same = tables[other].filter(
                    pc.is_in(
                        tables[other].column("id"),
                        value_set=pa.array(r["ids_after_learning"], pa.string()),
                    )
                )
                rate = pc.sum(same.column("steps")).as_py() / max(
                    1, pc.sum(same.column("nfe")).as_py()
                )
                r[f"{other}_steps_per_forward_on_rows_after_learning"] = rate
        print(
            f"\nlearning: {r['rows_received']} rows recorded ({r['recording_seconds']:.1f} "
            f"replica-seconds recording), stopped: {r['stopped']}; "
            f"{r['rows_after_learning']} rows finished with the last drafter handed out, "
            f"steps/forward {r['steps_per_forward_after_learning'] or 0:.3f} (bundled on the "
            f"same rows: {r.get('bundled_steps_per_forward_on_rows_after_learning', 0):.3f})"
        )
        for x in r["rounds"]:
            budget = max(x["steps_per_forward_after"], key=int)
            print(
                f"  round {x['round']:>2} {x['kind']:<6} at {x['rows']:>5} rows: held-out "
                f"steps/fwd at budget {budget} {x['steps_per_forward_before'][budget]:.3f} -> "
                f"{x['steps_per_forward_after'][budget]:.3f}, {x['seconds']:.1f} s, "
                f"{'adopted' if x['adopted'] else 'not adopted'}"
            )
    if args.recording_rows:
        cost = recording_cost(args, rows[: args.recording_rows])
        print(
            f"\nrecording {cost['rows']} rows in one process (batch {args.batch_size}): "
            f"{cost['plain_seconds']:.2f} s without, {cost['recorded_seconds']:.2f} s with "
            f"({cost['recorded_seconds'] / cost['plain_seconds'] - 1:+.1%}); no extra forward"
        )
        results.append({"variant": "recording-cost"} | cost)
    if args.json:
        args.json.write_text(
            json.dumps(
                {"args": vars(args) | {"work": str(work)}, "results": results},
                indent=1,
                default=str,
            )
        )


if __name__ == "__main__":
    main()
