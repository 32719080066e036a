"""Drafters learned from the target's own decoding of prompts unlike the bundled corpus.

record: decode rows of the off-corpus stream (`bench/offcorpus_prompts.py`) draft-free and
keep their trajectories, one shard per `--chunk` rows (resumable: shards already there are
kept).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from offcorpus_prompts import SEED, offcorpus_prompts  # noqa: E402
from speculative import OrderOracle, Variant, run, table  # noqa: E402

from pipeline.drafter_data import encode, load_model_and_tokenizer  # noqa: E402
from spot.budget import AutoBudget, measure_forward_cost  # noqa: E402
from spot.builtin import builtin_drafter  # noqa: E402
from spot.config import DecodingConfig  # noqa: E402
from spot.decode import generate  # noqa: E402
from spot.drafters.learning import SPIFFY, SPOT, DrafterLearner, LearnerConfig  # noqa: E402
from spot.drafters.order_model import OrderModel, OrderModelConfig  # noqa: E402
from spot.drafters.recipes import recording_meta  # noqa: E402
from spot.drafters.registry import (  # noqa: E402
    acceptance_curve,
    load_drafter,
    load_order_model,
)
from spot.drafters.replay import STOPS, Replay, ReplayTarget, replay  # noqa: E402
from spot.drafters.spot import SpotDrafter  # noqa: E402
from spot.drafters.trajectory import Trajectories, TrajectoryRecorder  # noqa: E402


def decoding(args) -> DecodingConfig:
    return DecodingConfig(
        gen_length=args.gen_length, block_length=args.block_length, temperature=args.temperature
    )


def shard_path(folder: Path, start: int, stop: int) -> Path:
    return folder / f"rows-{start:06d}-{stop:06d}.pt"


def record(args) -> None:
    tokenizer, target = load_model_and_tokenizer(f"builtin:{args.target}")
    config = decoding(args)
    folder = Path(args.out_dir)
    for start in range(args.start, args.stop, args.chunk):
        stop = min(args.stop, start + args.chunk)
        path = shard_path(folder, start, stop)
        if path.exists():
            continue
        t0 = time.perf_counter()
        requests = encode(tokenizer, offcorpus_prompts(stop - start, args.seed, skip=start))
        keys = [r.key for r in requests]
        recorder = TrajectoryRecorder(keys, config.block_length, target.mask_id, 32, args.hidden)
        generate(target, requests, config, trace=recorder, max_active=args.batch_size)
        meta = recording_meta(config, target, len(requests))
        prompts = f"offcorpus seed {args.seed}"
        traj = recorder.result(meta | {"model": f"builtin:{args.target}", "prompts": prompts})
        traj.save(path)
        print(
            f"rows {start}-{stop}: {traj.segment.numel()} records, "
            f"{time.perf_counter() - t0:.0f} s -> {path}",
            flush=True,
        )


class TimedRecorder(TrajectoryRecorder):
    """A recorder that keeps the seconds its calls take."""

    seconds = 0.0

    def __call__(self, *args) -> None:
        t0 = time.perf_counter()
        super().__call__(*args)
        self.seconds += time.perf_counter() - t0

    def result(self, meta: dict) -> Trajectories:
        t0 = time.perf_counter()
        out = super().result(meta)
        self.seconds += time.perf_counter() - t0
        return out


def overhead(args) -> None:
    """What recording costs a decode: the same rows decoded with and without the trace (draft-
    free and with the bundled Spiffy at budget 2), taking turns pass by pass; the forwards are
    counted (the trace must add none) and the recorder's own calls timed."""
    tokenizer, target = load_model_and_tokenizer(f"builtin:{args.target}")
    config = decoding(args)
    requests = encode(tokenizer, offcorpus_prompts(args.prompts, args.seed))
    path = builtin_drafter(args.target, "spiffy", config.block_length, "static")
    variants = [("draft-free", None), ("Spiffy, budget 2", load_drafter("spiffy", path, 2, target))]
    totals: dict[tuple[str, bool], list[float]] = {}
    for number in range(args.passes):
        for name, drafter in variants[number % 2 :] + variants[: number % 2]:
            for traced in (number % 2 == 0, number % 2 == 1):
                recorder = None
                if traced:
                    keys = [r.key for r in requests]
                    recorder = TimedRecorder(keys, config.block_length, target.mask_id)
                t0 = time.perf_counter()
                results = generate(
                    target, requests, config, drafter, recorder, max_active=args.batch_size
                )
                if recorder is not None:
                    recorder.result(recording_meta(config, target, len(requests)))
                seconds = time.perf_counter() - t0
                forwards = sum(r.stats.forward_share for r in results)
                states = sum(r.stats.steps for r in results)
                row = totals.setdefault((name, traced), [0.0, 0.0, 0.0, 0.0])
                row[0] += seconds
                row[1] += forwards
                row[2] += recorder.seconds if recorder else 0.0
                row[3] += states
    print(
        f"{args.target}, {args.prompts} off-corpus prompts, batch {args.batch_size}, "
        f"{args.passes} passes, block {config.block_length}, gen {config.gen_length}"
    )
    print()
    print(
        "| decoder | recorded | forwards | states recorded | ms per forward | "
        "recorder ms per forward | recorder share of wall time |"
    )
    print("|---|---|---|---|---|---|---|")
    for (name, traced), (seconds, forwards, recording, states) in totals.items():
        print(
            f"| {name} | {'yes' if traced else 'no'} | {forwards / args.passes:.0f} | "
            f"{states / args.passes if traced else 0:.0f} | {seconds / forwards * 1e3:.2f} | "
            f"{recording / forwards * 1e3:.3f} | {recording / seconds:.1%} |"
        )


def load_rows(folder: str | Path, stop: int, start: int = 0) -> Trajectories:
    """The recorded shards of rows [start, stop) as one recording."""
    paths = sorted(Path(folder).glob("rows-*.pt"))
    chosen = [p for p in paths if start <= int(p.stem.split("-")[1]) < stop]
    return Trajectories.concat([Trajectories.load(p) for p in chosen], [p.name for p in chosen])


def shards(folder: str | Path) -> list[tuple[int, int, Path]]:
    """(first row, end row, path) of every recorded shard, in row order."""
    found = []
    for path in sorted(Path(folder).glob("rows-*.pt")):
        _, start, stop = path.stem.split("-")
        found.append((int(start), int(stop), path))
    return found


def learn(args) -> None:
    """Feed the recorded rows to a `DrafterLearner` in row order, a shard at a time, and let
    it make every round due (SPOT at each of --spot-rows); prints what each round measured on
    its held-out rows."""
    tokenizer, target = load_model_and_tokenizer(f"builtin:{args.target}")
    spot_rows = tuple(int(x) for x in args.spot_rows.split(","))
    config = LearnerConfig(
        spot_rows=spot_rows,
        min_gain=args.min_gain,
        epochs=args.epochs,
        warm_epochs=args.warm_epochs,
    )
    out = Path(args.out_dir)
    start = None
    if args.start_from_bundled:
        start, _ = load_order_model(builtin_drafter(args.target, "spot", args.block_length))
    elif args.start_from:
        start, _ = load_order_model(args.start_from)
    model_path = f"builtin:{args.target}"
    learner = DrafterLearner(ReplayTarget.of(target), out, config, model_path, start)
    rounds = []
    t0 = time.perf_counter()
    for _, stop, path in shards(args.rows_dir):
        if stop > args.rows:
            break
        learner.add(Trajectories.load(path))
        while learner.due() is not None:
            learner.learn()
            for r in learner.rounds[len(rounds) :]:
                rounds.append(r)
                print(json.dumps(r.to_dict() | {"elapsed": time.perf_counter() - t0}), flush=True)
            (out / "rounds.json").write_text(json.dumps([r.to_dict() for r in rounds], indent=1))
        if learner.done:
            break
    print()
    print(rounds_table(rounds, config))


def rounds_table(rounds, config: LearnerConfig) -> str:
    budgets = config.budgets
    lines = [
        "| round | drafter | rows (train / validation / held-out) | held-out accuracy | "
        + " | ".join(f"steps/forward at {b}, before → after" for b in budgets)
        + " | adopted | seconds |",
        "|---|---|---|---|" + "---|" * len(budgets) + "---|---|",
    ]
    for r in rounds:
        s = r.rows_by_slice
        accuracy = r.metrics.get("heldout_next_commit_accuracy")
        lines.append(
            f"| {r.number} | {r.kind} | {r.rows} ({s['train']} / {s['validation']} / "
            f"{s['heldout']}) | {'–' if accuracy is None else f'{accuracy:.3f}'} | "
            + " | ".join(f"{r.before[b]:.2f} → {r.after[b]:.2f}" for b in budgets)
            + f" | {'yes' if r.adopted else 'no'} | {r.seconds:.0f} |"
        )
    return "\n".join(lines)


def measuring_rows(args) -> Trajectories:
    start, stop = (int(x) for x in args.measure.split(":"))
    chosen = [(a, b, p) for a, b, p in shards(args.rows_dir) if start <= a and b <= stop]
    if not chosen or chosen[0][0] != start or chosen[-1][1] != stop:
        raise SystemExit(f"rows {start}:{stop} are not recorded in {args.rows_dir}")
    return Trajectories.concat([Trajectories.load(p) for *_, p in chosen])


def commits_of(traj: Trajectories) -> dict[tuple[int, int], torch.Tensor]:
    """(request key, step) -> [B] positions the target committed from that state."""
    return {
        (int(k), int(s)): c
        for k, s, c in zip(traj.key.tolist(), traj.step.tolist(), traj.committed)
    }


def learned_drafters(folder: Path, budget: int, target) -> list[tuple[str, object]]:
    """(label, drafter factory) of the learner's rounds: each SPOT round, and the Spiffy
    graph calibrated on the same rows."""
    if not (folder / "rounds.json").exists():
        return []
    rounds = json.loads((folder / "rounds.json").read_text())
    out = []
    for r in rounds:
        if r["kind"] == "spiffy" and not any(
            q["kind"] == "spot" and q["rows"] == r["rows"] for q in rounds
        ):
            continue
        label = f"learned {'SPOT' if r['kind'] == 'spot' else 'Spiffy'}, {r['rows']} rows"
        out.append((label, lambda r=r: load_drafter(r["kind"], r["path"], budget, target)))
    return out


def untrained() -> OrderModel:
    return OrderModel(OrderModelConfig())


def saved_replay(entry: dict) -> Replay:
    return Replay(
        {int(k): v for k, v in entry["forwards"].items()},
        {int(k): v for k, v in entry["steps"].items()},
        Counter(entry["stops"]),
    )


def measure(args) -> None:
    """Forwards on the measuring rows (none of which the learner saw), by replaying the
    decode loop over their recorded trajectories (`spot.drafters.replay`, which counts the
    decoder's own forwards at T=0; --check decodes the first rows to confirm it). With
    --results, replays already saved there are read back instead of run again (a learner's
    later rounds are measured as they come)."""
    tokenizer, target = load_model_and_tokenizer(f"builtin:{args.target}")
    held = measuring_rows(args)
    replay_target = ReplayTarget.of(target)
    records = held.segment.numel()
    requests = int(held.key.unique().numel())
    commits = commits_of(held)
    saved_path = Path(args.results) if args.results else None
    saved = json.loads(saved_path.read_text()) if saved_path and saved_path.exists() else {}
    print(
        f"{args.target}, measuring rows {args.measure} ({requests} prompts, {records} "
        f"draft-free forwards), block {held.block_length}, gen {held.meta['gen_length']}"
    )
    spiffy, spot = (builtin_drafter(args.target, k, held.block_length) for k in (SPIFFY, SPOT))
    for budget in (int(b) for b in args.budgets.split(",")):
        variants = [
            ("bundled Spiffy", lambda b=budget: load_drafter(SPIFFY, spiffy, b, target)),
            ("bundled SPOT", lambda b=budget: load_drafter(SPOT, spot, b, target)),
            *(d for f in args.learned for d in learned_drafters(Path(f), budget, target)),
            ("SPOT untrained (the rule's guess)", lambda b=budget: SpotDrafter(untrained(), b)),
            ("order oracle", lambda b=budget: OrderOracle(commits, b)),
        ]
        rows = []
        for name, make in variants:
            key = f"{args.measure} {budget} {name}"
            if key in saved and not args.check:
                rows.append((name, saved_replay(saved[key]), saved[key]["seconds"]))
                continue
            drafter = make()
            t0 = time.perf_counter()
            result = replay(drafter, held, replay_target, keep_walks=False)
            rows.append((name, result, time.perf_counter() - t0))
            if args.check:
                check_replay(args, tokenizer, target, held, drafter, result)
                print(f"checked: {name} at budget {budget}, {args.check} prompts", flush=True)
            if saved_path:
                saved[key] = {
                    "forwards": result.forwards,
                    "steps": result.steps,
                    "stops": dict(result.stops),
                    "seconds": rows[-1][2],
                }
                saved_path.write_text(json.dumps(saved))
        print()
        print(f"budget {budget}:")
        print()
        print(forwards_table(rows, records))


def forwards_table(rows, records: int) -> str:
    """Forwards of each decoder and its saving (steps per forward - 1: the forwards a
    drafter saves per forward it takes) against Spiffy's, bundled and learned (the learned
    Spiffy calibrated on the same rows, or on the most rows for the others)."""
    by_name = {name: result for name, result, _ in rows}
    learned = {n.split(", ")[1]: r for n, r in by_name.items() if n.startswith("learned Spiffy")}
    most = learned[max(learned, key=lambda n: int(n.split()[0]))] if learned else None
    lines = [
        "| decoder | forwards | steps/forward | fewer forwards than draft-free | "
        "saving vs bundled Spiffy | saving vs learned Spiffy | walks stopped by "
        + " / ".join(STOPS)
        + " |",
        "|---|---|---|---|---|---|---|",
        f"| draft-free | {records} | 1.00 | 1.00x | – | – | – |",
    ]

    def saving(r):
        return r.steps_per_forward - 1

    for name, result, _ in rows:
        f = sum(result.forwards.values())
        spiffy = learned.get(name.split(", ")[-1], most) if name.startswith("learned") else most
        vs_learned = f"{saving(result) / saving(spiffy):.3f}x" if spiffy else "–"
        vs_bundled = saving(result) / saving(by_name["bundled Spiffy"])
        lines.append(
            f"| {name} | {f} | {result.steps_per_forward:.3f} | {records / f:.2f}x | "
            f"{vs_bundled:.3f}x | {vs_learned} | "
            + " / ".join(f"{result.stops[k] / result.stops.total():.0%}" for k in STOPS)
            + " |"
        )
    return "\n".join(lines)


def check_replay(args, tokenizer, target, held, drafter, result) -> None:
    """Decode the first --check measuring prompts with `drafter`: each must take the
    forwards its replay counted."""
    start = int(args.measure.split(":")[0])
    prompts = encode(tokenizer, offcorpus_prompts(args.check, args.seed, skip=start))
    config = DecodingConfig(gen_length=int(held.meta["gen_length"]), block_length=held.block_length)
    decoded = generate(target, prompts, config, drafter=drafter, max_active=8)
    for request, out in zip(prompts, decoded):
        if result.forwards[request.key] != out.stats.nfe:
            raise SystemExit(
                f"replay counted {result.forwards[request.key]} forwards, the decoder "
                f"{out.stats.nfe}, for request {request.key}"
            )


def accuracy(args) -> None:
    """Next-commit accuracy by depth on the measuring rows: the rule's guess (the most
    confident stale position), and each SPOT's root evaluation reused at that depth (what its
    tree ranks by), bundled and learned."""
    from order_accuracy import by_depth

    held = measuring_rows(args)
    models = [("bundled SPOT", builtin_drafter(args.target, "spot", held.block_length))]
    rounds = json.loads((Path(args.learned) / "rounds.json").read_text())
    spots = [r for r in rounds if r["kind"] == "spot"]
    models += [(f"learned SPOT, {r['rows']} rows", r["path"]) for r in spots]
    columns, rule = [], None
    for name, path in models:
        model, _ = load_order_model(path)
        _, depth, _, (rule_hits, _, root, has_root) = by_depth(model, held)
        rule = rule or (rule_hits, depth, has_root)
        columns.append((name, root))
    rule_hits, depth, has_root = rule
    print(f"{args.target}, measuring rows {args.measure}")
    print()
    print("| depth | samples | rule's guess | " + " | ".join(n for n, _ in columns) + " |")
    print("|---|---|---|" + "---|" * len(columns))
    for j in range(1, 9):
        m = (depth == j) & has_root
        print(
            f"| {j} | {int(m.sum())} | {rule_hits[m].mean():.3f} | "
            + " | ".join(f"{root[m].mean():.3f}" for _, root in columns)
            + " |"
        )


def tree(args) -> None:
    """Steps per forward of one SPOT order model's tree by its shape (prior scale, token
    choices per position, children per node), replayed at --budget on rows the model did not
    learn from: how much of what limits SPOT is the tree rather than the order model."""
    _, target = load_model_and_tokenizer(f"builtin:{args.target}")
    held = measuring_rows(args)
    replay_target = ReplayTarget.of(target)
    model, _ = load_order_model(args.drafter)
    trained = float(model.prior_scale.detach())
    scales = [trained, *args.scales]
    print(f"{args.drafter}, rows {args.measure}, budget {args.budget}")
    print()
    print(
        "| prior scale | token choices | children per node | steps/forward | stopped by "
        + " / ".join(STOPS)
        + " |"
    )
    print("|---|---|---|---|---|")
    for scale in scales:
        model.prior_scale.data.fill_(scale)
        for choices in args.token_choices:
            for branching in args.branching:
                drafter = SpotDrafter(
                    model, args.budget, branching=branching, token_choices=choices
                )
                result = replay(drafter, held, replay_target, keep_walks=False)
                stops = " / ".join(f"{result.stops[k] / result.stops.total():.0%}" for k in STOPS)
                print(
                    f"| {scale:.3g} | {choices} | {branching} | "
                    f"{result.steps_per_forward:.3f} | {stops} |",
                    flush=True,
                )


def speed(args) -> None:
    """Tokens/s with `drafter.budget: auto` on the first --prompts measuring rows, every
    decoder taking turns batch by batch (bench/speculative.py's `run`), with its forward cost
    measured at start-up; the ratios are what to read."""
    tokenizer, target = load_model_and_tokenizer(f"builtin:{args.target}")
    held = measuring_rows(args)
    start = int(args.measure.split(":")[0])
    requests = encode(tokenizer, offcorpus_prompts(args.prompts, args.seed, skip=start))
    held = held.of_requests([r.key for r in requests])
    config = DecodingConfig(gen_length=int(held.meta["gen_length"]), block_length=held.block_length)
    b = config.block_length
    cost = measure_forward_cost(target, b, 4 * b, [1, 2, 4, 8, 16, 32, 17])
    learned = Path(args.learned)
    rounds = json.loads((learned / "rounds.json").read_text())
    last = {r["kind"]: r for r in rounds}  # the last round of each kind
    drafters = [
        ("bundled Spiffy", "spiffy", builtin_drafter(args.target, "spiffy", b)),
        ("bundled SPOT", "spot", builtin_drafter(args.target, "spot", b)),
        (f"learned Spiffy, {last['spiffy']['rows']} rows", "spiffy", last["spiffy"]["path"]),
        (f"learned SPOT, {last['spot']['rows']} rows", "spot", last["spot"]["path"]),
    ]
    variants = [Variant("draft-free", "0", config)]
    for label, kind, path in drafters:
        auto = AutoBudget(load_drafter(kind, path, 16, target), acceptance_curve(kind, path), cost)
        variants.append(Variant(f"{label} auto", "auto", config, auto))
        for budget in args.fixed:
            fixed = load_drafter(kind, path, budget, target)
            variants.append(Variant(label, str(budget), config, fixed))
    commits = commits_of(held)
    for budget in args.fixed:
        variants.append(Variant("order oracle", str(budget), config, OrderOracle(commits, budget)))
    ends = {(k, s) for k, s in commits if (k, s + 1) not in commits}
    rows = run(variants, target, requests, 1, commits, ends)
    print(table(args.target, rows, config, 1, exact_to="draft-free"))
    print()
    print(
        "forward cost (states -> ms):",
        ", ".join(f"{n}: {sec * 1e3:.1f}" for n, sec in zip(cost.states, cost.seconds)),
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record", help=record.__doc__)
    rec.add_argument("--start", type=int, default=0)
    rec.add_argument("--stop", type=int, default=4800)
    rec.add_argument("--chunk", type=int, default=200)
    rec.add_argument("--batch-size", type=int, default=16)
    rec.add_argument("--out-dir", required=True)
    rec.add_argument("--hidden", action="store_true", help="keep the last hidden states too")
    lrn = sub.add_parser("learn", help=learn.__doc__)
    lrn.add_argument("--rows-dir", required=True)
    lrn.add_argument("--out-dir", required=True)
    lrn.add_argument("--rows", type=int, default=4800, help="learn from the first ROWS rows")
    lrn.add_argument("--spot-rows", default="600,2400,4800")
    lrn.add_argument(
        "--min-gain", type=float, default=-1.0, help="the learner's (default: every round)"
    )
    lrn.add_argument("--epochs", type=int, default=6)
    lrn.add_argument("--warm-epochs", type=int, default=3)
    lrn.add_argument(
        "--start-from-bundled",
        action="store_true",
        help="the first SPOT round continues from the target's bundled SPOT",
    )
    lrn.add_argument(
        "--start-from",
        help="a SPOT drafter file the first SPOT round continues from (with --warm-epochs: "
        "a later round of an earlier learn, made on its own)",
    )
    mea = sub.add_parser("measure", help=measure.__doc__)
    mea.add_argument("--rows-dir", required=True)
    mea.add_argument(
        "--learned", required=True, action="append", help="a learn --out-dir (repeatable)"
    )
    mea.add_argument("--measure", default="4800:5400", help="measuring rows, start:stop")
    mea.add_argument("--budgets", default="16,2")
    mea.add_argument("--check", type=int, default=0, help="decode this many to check")
    mea.add_argument("--results", help="a JSON file of replays to reuse and extend")
    acc = sub.add_parser("accuracy", help=accuracy.__doc__)
    acc.add_argument("--rows-dir", required=True)
    acc.add_argument("--learned", required=True, help="a learn --out-dir")
    acc.add_argument("--measure", default="4800:5000", help="measuring rows, start:stop")
    tre = sub.add_parser("tree", help=tree.__doc__)
    tre.add_argument("--rows-dir", required=True)
    tre.add_argument("--drafter", required=True, help="a SPOT drafter file")
    tre.add_argument("--measure", default="4600:4800", help="rows, start:stop")
    tre.add_argument("--budget", type=int, default=16)
    tre.add_argument(
        "--scales", type=lambda t: [float(x) for x in t.split(",") if x], default=[2.0, 4.0]
    )
    tre.add_argument(
        "--token-choices", type=lambda t: [int(x) for x in t.split(",")], default=[1, 2, 3]
    )
    tre.add_argument("--branching", type=lambda t: [int(x) for x in t.split(",")], default=[4])
    spd = sub.add_parser("speed", help=speed.__doc__)
    spd.add_argument("--rows-dir", required=True)
    spd.add_argument("--learned", required=True, help="a learn --out-dir")
    spd.add_argument("--measure", default="4800:5400", help="measuring rows, start:stop")
    spd.add_argument("--prompts", type=int, default=40)
    spd.add_argument(
        "--fixed",
        type=lambda t: [int(x) for x in t.split(",") if x],
        default=[2],
        help="fixed budgets beside auto",
    )
    over = sub.add_parser("overhead", help=overhead.__doc__)
    over.add_argument("--prompts", type=int, default=64)
    over.add_argument("--batch-size", type=int, default=8)
    over.add_argument("--passes", type=int, default=4)
    for q in (rec, lrn, mea, acc, tre, spd, over):
        q.add_argument("--target", default="sdar-tiny")
        q.add_argument("--seed", type=int, default=SEED)
        q.add_argument("--block-length", type=int, default=32)
        q.add_argument("--gen-length", type=int, default=64)
        q.add_argument("--temperature", type=float, default=0.0)
    args = p.parse_args()
    torch.set_grad_enabled(False)
    commands = {
        "record": record,
        "learn": learn,
        "measure": measure,
        "accuracy": accuracy,
        "tree": tree,
        "speed": speed,
        "overhead": overhead,
    }
    commands[args.command](args)


if __name__ == "__main__":
    main()
