"""How well can the next commit be told from the stale distribution, by lookahead depth?

On the held-out blocks of recorded draft-free trajectories (the split `train-drafter` holds
out), for a hypothesis j steps after the stale forward (the target's own commits in between):
the next-commit accuracy of the commit rule's own guess (the most confident stale position
left), of the order model evaluated at that hypothesis, and of the order model's evaluation
at depth 1 reused over the positions left, which is what a SPOT tree does (one evaluation
per tree, at its root).

    .venv/bin/python bench/order_accuracy.py --trajectories build/drafters/sdar-tiny-b32.pt \
        --drafter spot/builtin/drafters/sdar-tiny/spot-b32.safetensors
"""

from __future__ import annotations

import argparse
import math

import torch

from spot.drafters.order_model import DOUBT_SCALE
from spot.drafters.registry import load_order_model
from spot.drafters.training import build_samples
from spot.drafters.trajectory import Trajectories


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--trajectories", required=True)
    p.add_argument("--drafter", required=True, help="a SPOT checkpoint")
    p.add_argument("--heldout", type=float, default=0.1)
    args = p.parse_args()
    torch.set_grad_enabled(False)
    model, _ = load_order_model(args.drafter, "spot")
    _, held = Trajectories.load(args.trajectories).split(args.heldout)
    samples, depth, rank, hits = by_depth(model, held)
    rule, fresh, root, has_root = hits
    print(f"{args.trajectories}, held-out {args.heldout:.0%} of blocks")
    print()
    print("| depth | samples | rule's guess | order model | root evaluation reused |")
    print("|---|---|---|---|---|")
    for j in range(1, model.config.max_lookahead + 1):
        m = (depth == j) & has_root
        print(
            f"| {j} | {int(m.sum())} | {rule[m].mean():.3f} | {fresh[m].mean():.3f} | "
            f"{root[m].mean():.3f} |"
        )
    print()
    by_confidence(samples, model.config, depth == 1, rank, rule, fresh)


def by_depth(model, traj: Trajectories):
    """Samples at every depth of `traj`, their depths and confidence ranks, and per sample
    whether the next commit is the rule's guess, the order model's evaluated there, and the
    root's evaluation reused there (with whether the sample's root is among the samples)."""
    config = model.config
    samples = build_samples(traj, config)
    depth = (samples.features[:, 0, -1] * config.max_lookahead).round().long()
    logits = torch.cat(
        [
            model(samples.features[s : s + 4096], samples.masked[s : s + 4096])
            for s in range(0, depth.numel(), 4096)
        ]
    )
    rank = samples.features[..., config.rank_index].masked_fill(~samples.masked, 2.0)
    root_of = {int(i): n for n, i in enumerate(samples.stale_index) if depth[n] == 1}
    has_root = torch.tensor([int(i) in root_of for i in samples.stale_index])
    root_rows = logits[[root_of.get(int(i), 0) for i in samples.stale_index]]
    reused = root_rows.masked_fill(~samples.masked, float("-inf"))

    def hits(pick: torch.Tensor) -> torch.Tensor:
        return samples.label.gather(1, pick[:, None]).squeeze(1).float()

    rule, fresh, root = hits(rank.argmin(-1)), hits(logits.argmax(-1)), hits(reused.argmax(-1))
    return samples, depth, rank, (rule, fresh, root, has_root)


def by_confidence(samples, config, rows, rank, rule, model) -> None:
    """Depth 1 by the stale confidence of the rule's guess: how much of the order is decided
    among positions the stale forward already called near-certain, and how often the target
    took the rule's runner-up instead."""
    guess = rank.argmin(-1)
    doubt = samples.features[..., config.log_doubt_index] * DOUBT_SCALE  # log(1 - confidence)
    guess_doubt = doubt.gather(1, guess[:, None]).squeeze(1)
    runner_up = rank.masked_fill(rank.eq(rank.min(-1, keepdim=True).values), 2.0).argmin(-1)
    second = samples.label.gather(1, runner_up[:, None]).squeeze(1) & (rule == 0)
    print(
        "| rule's guess: stale confidence | share | rule's guess | order model | "
        "errors where the target took the runner-up |"
    )
    print("|---|---|---|---|---|")
    for name, lo, hi in BANDS:
        m = (
            rows
            & (guess_doubt <= math.log(1 - lo))
            & (guess_doubt > (math.log(1 - hi) if hi < 1 else -math.inf))
        )
        errors = m & (rule == 0)
        print(
            f"| {name} | {m.float().sum() / rows.sum():.3f} | {rule[m].mean():.3f} | "
            f"{model[m].mean():.3f} | {second[errors].sum() / max(1, errors.sum()):.3f} |"
        )


BANDS = (
    ("below 0.9", 0.0, 0.9),
    ("0.9-0.9999", 0.9, 0.9999),
    ("0.9999-0.99999999", 0.9999, 1 - 1e-8),
    ("above 0.99999999", 1 - 1e-8, 1.0),
)


if __name__ == "__main__":
    main()
