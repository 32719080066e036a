"""Draft-free vs Spiffy vs SPOT (and SPOT-Sets for threshold decoding) on the same prompts,
in one process, one table per target. Ratios are what to read: this machine is noisy, so the
decoders take turns batch by batch (`run`).

    .venv/bin/python bench/speculative.py --targets sdar-tiny --prompts 40 --block-length 32

Rows: draft-free; Spiffy (the budget's most frequent paths of its calibrated graph) and SPOT,
each at the fixed budget (NFE-optimal), with `auto` (throughput-optimal from the measured
forward cost) and at any --larger-budgets (the oracle too: do larger trees close the gap?);
SPOT with an untrained order model (exactly the rule's own guess, most confident first: what
training adds), also with sharper scores (--rule-sharpness); a perfect
order oracle (true next positions, tokens drafted from the stale logits like SPOT) with the
same budget and with small ones, to show what order prediction alone could reach in NFE and
in tokens/s; transfer rows (a drafter trained on another bundled target, unchanged; for
SPOT-Sets, with its two width projections refit, --adapted-sets).
With --rule threshold: threshold alone, threshold + Spiffy (its graph calibrated on threshold
trajectories), threshold + SPOT-Sets, and standard 1-token decoding as the baseline.
The last column says why verification walks stopped (`walk_stop`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import Counter
from dataclasses import dataclass

import torch

from pipeline.drafter_data import corpus_prompts, encode, load_model_and_tokenizer
from spot.budget import AutoBudget, measure_forward_cost
from spot.builtin import builtin_drafter
from spot.config import DecodingConfig
from spot.decode import generate
from spot.drafters.order_model import OrderModel, OrderModelConfig
from spot.drafters.registry import acceptance_curve, load_drafter
from spot.drafters.replay import STOPS
from spot.drafters.replay import walk_stop as replay_walk_stop
from spot.drafters.spot import SpotDrafter
from spot.drafting import Drafter
from spot.models.loading import DTYPES
from spot.tree import DraftTree, advance


@dataclass
class Row:
    name: str
    budget: str
    nfe: list[int]
    steps: int
    tokens: int
    seconds: float
    drafter_seconds: float
    outputs: list[list[int]]
    stops: Counter  # why verification walks stopped (see `walk_stop`)

    @property
    def mean_nfe(self) -> float:
        return statistics.mean(self.nfe)


class OrderOracle(Drafter):
    """Knows which positions the target commits next (from a recorded draft-free run);
    drafts their tokens from the stale logits under the coupled noise, like SPOT."""

    def __init__(self, commits: dict[tuple[int, int], torch.Tensor], budget: int):
        self.commits = commits  # (request key, step) -> [B] bool committed positions
        self.budget = budget

    def propose(self, inputs, noise, batch_size):
        trees = []
        for inp in inputs:
            nodes, cur = [inp.root], inp.root
            b = inp.layout.block_length
            same_block = inp.root.block_start(b) == inp.stale_state.block_start(b)
            while same_block and len(nodes) <= self.budget and not cur.done:
                positions = self.commits.get((inp.key, cur.step))
                if positions is None or cur.block_start(b) != inp.stale_state.block_start(b):
                    break
                tokens, _ = noise.draw(inp, cur.step)
                block = cur.block(b).clone()
                block[positions] = tokens[positions]
                cur = advance(inp.layout, cur, block)
                nodes.append(cur)
            trees.append(DraftTree(tuple(nodes), tuple(range(-1, len(nodes) - 1))))
        return trees


def walk_stop(
    tree: DraftTree, path: list[int], target_commits: torch.Tensor, ended: bool, mask_id: int
) -> str:
    """Why a verification walk stopped at its last accepted node (`replay.walk_stop`), or
    "end": the target's transition from it completed the request (nothing was left to
    draft). target_commits: [B] the positions the target committed from that node."""
    if ended and len(tree.nodes) > 1:
        return "end"
    return replay_walk_stop(tree, path[-1], target_commits, mask_id)


@dataclass
class Variant:
    """One row's decoder: a drafter (None: draft-free) under a decoding config."""

    name: str
    budget: str
    config: DecodingConfig
    drafter: object | None = None
    classify: bool = True  # count why walks stopped (needs the draft-free run's commits)


def run(variants, target, requests, batch_size, commits=None, ends=()) -> list[Row]:
    """Every variant on every batch, interleaved: batch by batch, each variant in turn (the
    order rotated per batch), so that a slow spell of the machine falls on all rows alike
    instead of on whichever rows ran then (run one after another, two identical draft-free
    rows differed by up to 10% in tokens/s; interleaved, by 2%).

    commits: (request key, step) -> [B] positions the target commits from that step, from a
    draft-free run, and ends: the (request key, step) whose transition completed the request;
    with them, why each walk stopped is counted for variants that `classify`."""
    rows = [Row(v.name, v.budget, [], 0, 0, 0.0, 0.0, [], Counter()) for v in variants]
    for number, s in enumerate(range(0, len(requests), batch_size)):
        batch = requests[s : s + batch_size]
        turn = number % len(variants)
        for k in [*range(turn, len(variants)), *range(turn)]:
            variant, row = variants[k], rows[k]

            def on_walk(index, tree, path, batch=batch, stops=row.stops):
                at = (batch[index].key, tree.nodes[path[-1]].step)
                stops[walk_stop(tree, path, commits[at], at in ends, target.mask_id)] += 1

            observe = on_walk if commits is not None and variant.classify else None
            t0 = time.perf_counter()
            results = generate(
                target, batch, variant.config, drafter=variant.drafter, on_walk=observe
            )
            row.seconds += time.perf_counter() - t0
            for r in results:
                row.nfe.append(r.stats.nfe)
                row.steps += r.stats.steps
                row.drafter_seconds += r.stats.drafter_seconds
                ids = r.tokens.tolist()
                row.tokens += next((i for i, t in enumerate(ids) if t in target.eos_ids), len(ids))
                row.outputs.append(ids)
    for variant, row in zip(variants, rows):
        if isinstance(variant.drafter, AutoBudget):
            row.budget = f"auto→{variant.drafter.chosen}"
    return rows


def pct(values, q):
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def table(
    target_name: str, rows: list[Row], config: DecodingConfig, batch_size: int, exact_to: str
) -> str:
    """Ratios are against the first row; `exact` compares outputs with the row `exact_to`
    (the draft-free decoder of the same rule)."""
    base, spiffy = rows[0], next((r for r in rows if r.name.startswith("Spiffy")), None)
    reference = next(r for r in rows if r.name == exact_to)
    lines = [
        f"### {target_name} — block {config.block_length}, gen {config.gen_length}, "
        f"{config.rule}, T={config.temperature}, batch {batch_size}, {len(base.nfe)} prompts",
        "",
        "| decoder | budget | NFE mean | p50 | p95 | steps/forward | NFE vs draft-free | "
        "NFE vs Spiffy | tokens/s | speed-up | drafter share | exact | walks stopped by "
        + " / ".join(STOPS)
        + " |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        vs_spiffy = f"{1 - r.mean_nfe / spiffy.mean_nfe:+.0%}" if spiffy else "–"
        tps = r.tokens / r.seconds
        lines.append(
            f"| {r.name} | {r.budget} | {r.mean_nfe:.1f} | {pct(r.nfe, 50):.0f} | "
            f"{pct(r.nfe, 95):.0f} | {r.steps / sum(r.nfe):.2f} | "
            f"{base.mean_nfe / r.mean_nfe:.2f}x | {vs_spiffy} | {tps:.1f} | "
            f"{tps / (base.tokens / base.seconds):.2f}x | "
            f"{r.drafter_seconds / r.seconds:.1%} | "
            f"{'yes' if r.outputs == reference.outputs else 'NO'} | "
            + (" / ".join(f"{r.stops[k] / r.stops.total():.0%}" for k in STOPS) if r.stops else "–")
            + " |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--targets", nargs="+", default=["sdar-tiny"])
    p.add_argument("--transfer-from", default=None, help="target whose drafters to transfer")
    p.add_argument("--prompts", type=int, default=40)
    p.add_argument(
        "--prompts-file",
        default=None,
        help="JSON Lines with id and prompt columns, its first --prompts rows "
        "(default: the bundled held-out prompts)",
    )
    p.add_argument("--block-length", type=int, default=32)
    p.add_argument("--gen-length", type=int, default=128)
    p.add_argument("--rule", choices=["static", "threshold"], default="static")
    p.add_argument("--threshold", type=float, default=0.9)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--budget", type=int, default=16)
    p.add_argument(
        "--adapted-sets",
        default=None,
        help="threshold rule: the --transfer-from target's SPOT-Sets adapted to this target "
        "(train-drafter --kind spot-sets --adapt-from ...), for the transfer row",
    )
    p.add_argument(
        "--oracle-budgets",
        type=lambda text: [int(b) for b in text.split(",") if b],
        default=[1, 2, 3, 4, 6],
        help="extra budgets for the oracle rows: the best tokens/s any order predictor reaches",
    )
    p.add_argument(
        "--larger-budgets",
        type=lambda text: [int(b) for b in text.split(",") if b],
        default=[],
        help="extra rows of this target's own drafters at these budgets (NFE: do larger trees "
        "close the gap to the oracle?); the oracle rows take them too",
    )
    p.add_argument(
        "--rule-sharpness",
        type=lambda text: [float(x) for x in text.split(",") if x],
        default=[1.0, 4.0],
        help="untrained SPOT rows: the rule's guess with its scores -log(1 - confidence) "
        "multiplied by these (1: the untrained model; larger: more of the budget on its chain)",
    )
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    args = p.parse_args()
    torch.set_grad_enabled(False)
    for name in args.targets:
        bench_target(name, args)


def bench_target(name: str, args) -> None:
    tokenizer, target = load_model_and_tokenizer(f"builtin:{name}", args.dtype)
    if args.prompts_file:
        with open(args.prompts_file) as f:
            prompts = [json.loads(line) for line in f if line.strip()][: args.prompts]
    else:
        prompts = corpus_prompts("heldout", args.prompts)
    requests = encode(tokenizer, prompts)
    static = DecodingConfig(
        gen_length=args.gen_length,
        block_length=args.block_length,
        temperature=args.temperature,
    )
    config = (
        static
        if args.rule == "static"
        else DecodingConfig(
            gen_length=args.gen_length,
            block_length=args.block_length,
            rule="threshold",
            threshold=args.threshold,
            temperature=args.temperature,
        )
    )
    commits: dict[tuple[int, int], torch.Tensor] = {}
    ends: set[tuple[int, int]] = set()
    keys = []

    def record(index, state, logits, successor, hidden):
        b = config.block_length
        width = state.span.numel()
        before, after = state.block(b), successor.span[width - b : width]
        commits[(keys[index], state.step)] = (before == target.mask_id) & (after != before)
        if successor.done:
            ends.add((keys[index], state.step))

    variants = []
    if args.rule == "threshold":
        variants.append(Variant("standard (1 token/step)", "0", static, classify=False))
    base_name = "draft-free" if args.rule == "static" else f"threshold {args.threshold}"
    for s in range(0, len(requests), args.batch_size):
        keys[:] = [r.key for r in requests[s : s + args.batch_size]]
        generate(target, requests[s : s + args.batch_size], config, trace=record)
    variants.append(Variant(base_name, "0", config))
    cost = measure_forward_cost(
        target,
        args.block_length,
        4 * args.block_length,
        [1, 2, 4, 8, 16, 32, args.batch_size * (args.budget + 1)],
    )
    sources = [name] + ([args.transfer_from] if args.transfer_from not in (None, name) else [])
    kinds = ["spiffy", "spot"] if args.rule == "static" else ["spiffy", "spot-sets"]
    for source in sources:
        for kind in kinds:
            path = builtin_drafter(source, kind, args.block_length, args.rule)
            label = {"spiffy": "Spiffy", "spot": "SPOT", "spot-sets": "SPOT-Sets"}[kind]
            if source != name:
                label += f" (from {source})"
            if kind == "spot-sets" and source != name:
                path = args.adapted_sets  # projections are per target width: refit ones
                if path is None:
                    continue
                label = f"SPOT-Sets (adapted from {source})"
            drafter = load_drafter(kind, path, args.budget, target)
            variants.append(Variant(label, str(args.budget), config, drafter))
            if source == name:
                curve = acceptance_curve(kind, path)
                auto = AutoBudget(load_drafter(kind, path, args.budget, target), curve, cost)
                variants.append(Variant(label + " auto", "auto", config, auto))
                for budget in args.larger_budgets:
                    larger = load_drafter(kind, path, budget, target)
                    variants.append(Variant(label, str(budget), config, larger))
    if args.rule == "static":
        for sharpness in args.rule_sharpness:
            untrained = OrderModel(OrderModelConfig())
            untrained.prior_scale.data.fill_(sharpness)
            label = f"SPOT untrained (the rule's guess, x{sharpness:g})"
            variants.append(
                Variant(label, str(args.budget), config, SpotDrafter(untrained, args.budget))
            )
        for budget in sorted({args.budget, *args.oracle_budgets, *args.larger_budgets}):
            oracle = OrderOracle(commits, budget)
            variants.append(Variant("order oracle", str(budget), config, oracle))
    rows = run(variants, target, requests, args.batch_size, commits, ends)
    print(table(name, rows, config, args.batch_size, exact_to=base_name))
    print()
    print(
        "forward cost (states -> ms):",
        ", ".join(f"{n}: {s * 1e3:.1f}" for n, s in zip(cost.states, cost.seconds)),
    )
    print()


if __name__ == "__main__":
    main()
