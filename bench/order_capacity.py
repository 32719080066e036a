"""Does a larger order model find more in the same features?

Trains SPOT's order model at the shipped size and at larger ones on one recording, with the
recipe of `train-drafter --objective order` (same split, epochs, optimiser, seed), and prints
per size: parameters, training minutes, next-commit accuracy on the training and held-out
blocks, the held-out order log-likelihood, and the steps per forward its tree reaches at the
drafter budget on held-out prompts. The checkpoints are kept in --out-dir, for
bench/order_accuracy.py.

    .venv/bin/python bench/order_capacity.py --trajectories build/drafters/sdar-tiny-b32-2400.pt \
        --model builtin:sdar-tiny --sizes 128x3x512,192x4x768
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from pipeline.drafter_data import corpus_prompts, encode, load_model_and_tokenizer
from spot.drafters.files import save_order_model
from spot.drafters.order_model import OrderModelConfig
from spot.drafters.recipes import measure_acceptance, recorded_decoding, train_spot, trained_on
from spot.drafters.spot import SpotDrafter
from spot.drafters.trajectory import Trajectories


def size(text: str) -> OrderModelConfig:
    """d_model x layers x feed-forward size, e.g. 128x3x512 (the shipped size)."""
    d_model, layers, ff = (int(x) for x in text.split("x"))
    return OrderModelConfig(d_model=d_model, num_layers=layers, ff_size=ff)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--trajectories", required=True)
    p.add_argument("--model", required=True, help="the target the trajectories come from")
    p.add_argument("--sizes", type=lambda t: [size(s) for s in t.split(",")], required=True)
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--heldout", type=float, default=0.1)
    p.add_argument("--budget", type=int, default=16)
    p.add_argument("--eval-prompts", type=int, default=40)
    p.add_argument("--out-dir", default="build/order-capacity")
    args = p.parse_args()
    traj = Trajectories.load(args.trajectories)
    tokenizer, target = load_model_and_tokenizer(args.model)
    requests = encode(tokenizer, corpus_prompts("heldout", args.eval_prompts))
    rows = []
    for config in args.sizes:
        t0 = time.perf_counter()
        model, metrics = train_spot(traj, args.epochs, args.heldout, "order", config)
        minutes = (time.perf_counter() - t0) / 60
        drafter = SpotDrafter(model, args.budget)
        curve = measure_acceptance(
            target, drafter, requests, recorded_decoding(traj.meta), batch_size=8
        )
        name = f"{config.d_model}x{config.num_layers}x{config.ff_size}"
        save_order_model(
            Path(args.out_dir) / f"spot-{name}.safetensors",
            model,
            "spot",
            {
                "trained_on": trained_on(traj.meta, args.model),
                "metrics": metrics,
                "acceptance_curve": curve,
            },
        )
        params = sum(p.numel() for p in model.parameters())
        rows.append(
            f"| {name} | {params / 1e6:.2f}M | {minutes:.1f} | "
            f"{metrics['train_next_commit_accuracy']:.3f} | "
            f"{metrics['heldout_next_commit_accuracy']:.3f} | "
            f"{metrics['heldout_order_log_likelihood']:.3f} | "
            f"{curve['steps_per_forward'][-1]:.2f} |"
        )
    print(
        f"{args.trajectories}: {metrics['train_samples']} training and "
        f"{metrics['heldout_samples']} held-out root samples, {args.epochs} epochs"
    )
    print()
    print(
        "| d_model x layers x feed-forward | parameters | minutes | train accuracy | "
        f"held-out accuracy | held-out order log-likelihood | steps/forward at {args.budget} |"
    )
    print("|---|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
