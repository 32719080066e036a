"""How drafters for a target are made from its own decoding: record its draft-free
trajectories, train SPOT's order model or SPOT-Sets' set model on them, choose a SPOT tree's
sharpness by measured acceptance, and measure a drafter's acceptance curve.

These are what `record-trajectories`, `train-drafter` and `calibrate-spot` run; the commands
parse options, load the target and prompts, and save what these return. Spiffy's draft graph
is calibrated by `spot.drafters.spiffy.calibrate`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from spot.budget import CURVE_BUDGETS, acceptance_curve
from spot.config import DecodingConfig
from spot.decode import Request, generate
from spot.drafters.order_model import OrderModel, OrderModelConfig
from spot.drafters.spot import SpotDrafter
from spot.drafters.spot_sets import SetModel, SetModelConfig
from spot.drafters.training import (
    adapt_set_model,
    build_samples,
    root_samples,
    train_order_model,
    train_set_model,
)
from spot.drafters.trajectory import Trajectories, TrajectoryRecorder
from spot.target import Target

Progress = Callable[[int, int, float], None]  # (step, total steps, loss)

# How SPOT's order model learns: `next`, the next commit from hypotheses 1-8 steps past each
# stale forward; `order`, the order of the next 8 commits from each tree root (what a tree
# reads its root's scores as). Every shipped SPOT drafter was trained with `order`.
OBJECTIVES = {"next": build_samples, "order": root_samples}


def record_trajectories(
    target: Target,
    requests: Sequence[Request],
    config: DecodingConfig,
    batch_size: int,
    hidden: bool = False,
    on_batch: Callable[[], None] | None = None,
) -> Trajectories:
    """The target's own draft-free decoding of `requests`, batch by batch, as the
    trajectories drafters learn from; `hidden` keeps the hidden states SPOT-Sets reads.
    Their metadata is the decoding they were recorded with."""
    recorder = TrajectoryRecorder([], config.block_length, target.mask_id, record_hidden=hidden)
    for s in range(0, len(requests), batch_size):
        batch = requests[s : s + batch_size]
        recorder.keys = [r.key for r in batch]
        generate(target, batch, config, trace=recorder)
        if on_batch is not None:
            on_batch()
    return recorder.result(recording_meta(config, target, len(requests)))


def recording_meta(config: DecodingConfig, target: Target, requests: int) -> dict:
    """What a recording of `requests` requests of `target` says of how it was decoded."""
    return {
        "steps_per_block": config.steps_per_block,
        "block_length": config.block_length,
        "gen_length": config.gen_length,
        "rule": config.rule.value,  # a string: weights-only loading refuses enum classes
        "threshold": config.threshold,
        "temperature": config.temperature,
        "seed": config.seed,
        "confidence": config.confidence or target.confidence,
        "vocab_size": target.vocab_size,
        "hidden_size": target.hidden_size,
        "requests": requests,
    }


def trained_on(meta: dict, model_path: str) -> dict:
    """A drafter header's record of its trajectories and target: the recording's metadata
    without its per-request list."""
    return {k: meta[k] for k in meta if k != "requests"} | {"model": model_path}


def recorded_decoding(meta: dict) -> DecodingConfig:
    """The decoding that trajectories (and so the drafters trained on them) were recorded
    with."""
    return DecodingConfig(
        gen_length=int(meta["gen_length"]),
        block_length=int(meta["block_length"]),
        rule=meta["rule"],
        threshold=float(meta["threshold"]),
        tokens_per_step=int(meta["block_length"]) // int(meta["steps_per_block"]),
        temperature=float(meta["temperature"]),
        seed=int(meta["seed"]),
    )


def measure_acceptance(target, drafter, requests, config, batch_size: int) -> dict:
    """Steps per forward for every budget up to the drafter's, from one run (trees grow
    best-first, so a smaller budget's tree is a prefix of the larger one)."""
    walks = []
    for s in range(0, len(requests), batch_size):
        generate(
            target,
            requests[s : s + batch_size],
            config,
            drafter=drafter,
            on_walk=lambda i, tree, path: walks.append((tree, path)),
        )
    budgets = [b for b in CURVE_BUDGETS if b <= drafter.budget]
    return acceptance_curve(walks, budgets).to_dict()


def training_split(
    traj: Trajectories, heldout: float
) -> tuple[Trajectories, Trajectories, Trajectories]:
    """(train, validation, held out): `heldout` of the blocks is held out to report on, and
    the same fraction of the rest validates, to pick the epoch."""
    train, held = traj.split(heldout)
    train, validation = train.split(heldout)
    return train, validation, held


def train_spot(
    traj: Trajectories,
    epochs: int,
    heldout: float,
    objective: str = "order",
    config: OrderModelConfig | None = None,
    progress: Progress | None = None,
    start: OrderModel | None = None,
) -> tuple[OrderModel, dict]:
    """SPOT's order model (of `config`, default the shipped size) trained on `traj` with
    `objective` (see OBJECTIVES), and its metrics; `start` continues from a trained model."""
    config = start.config if start is not None else config or OrderModelConfig()
    samples = OBJECTIVES[objective]
    train, validation, held = training_split(traj, heldout)
    model, metrics = train_order_model(
        samples(train, config),
        samples(held, config),
        config,
        epochs,
        progress=progress,
        validation=samples(validation, config),
        model=start,
    )
    metrics["objective"] = objective
    return model, metrics


def train_spot_sets(
    traj: Trajectories,
    embed: Callable[[torch.Tensor], torch.Tensor],
    epochs: int,
    heldout: float,
    adapt_from: SetModel | None = None,
    progress: Progress | None = None,
) -> tuple[SetModel, dict]:
    """SPOT-Sets' set model trained on `traj` (recorded with hidden states) over the target's
    token embedding `embed`. With `adapt_from`, a set model trained for a target of another
    width: its network stays frozen and only the projections from this width train."""
    if traj.hidden is None:
        raise ValueError("SPOT-Sets needs trajectories recorded with hidden states")
    hidden_size = int(traj.meta["hidden_size"])
    train, validation, held = training_split(traj, heldout)
    config = SetModelConfig(target_hidden_size=hidden_size)
    start = None
    if adapt_from is not None:
        start = adapt_set_model(adapt_from, hidden_size)
        config = start.config
    return train_set_model(
        build_samples(train, config),
        build_samples(held, config),
        train.hidden,
        held.hidden,
        embed,
        config,
        epochs,
        progress=progress,
        validation=(build_samples(validation, config), validation.hidden),
        model=start,
    )


@dataclass(frozen=True)
class PriorScaleChoice:
    """What `choose_prior_scale` measured: steps per forward at the budget by prior scale."""

    trained: float
    measured: dict[float, float]
    chosen: float


def choose_prior_scale(
    model: OrderModel,
    target: Target,
    requests: Sequence[Request],
    config: DecodingConfig,
    budget: int,
    candidates: Sequence[float],
    trained: float | None = None,
    on_measured: Callable[[float, float], None] | None = None,
) -> PriorScaleChoice:
    """SPOT's tree sharpness by measured acceptance.

    Training fits the order model's probabilities to the next commits; the tree grows deeper
    chains from sharper ones. This runs the drafter at `budget` on `requests` (prompts the
    trajectories did not use) for the trained prior scale (`trained`, default the model's
    own) and each candidate, and leaves the model at the one with the most steps per
    forward (the trained one on a tie)."""
    trained = float(model.prior_scale.detach() if trained is None else trained)
    measured = {}
    for scale in [trained, *candidates]:
        model.prior_scale.data.fill_(scale)
        curve = measure_acceptance(target, SpotDrafter(model, budget), requests, config, 8)
        measured[scale] = curve["steps_per_forward"][-1]
        if on_measured is not None:
            on_measured(scale, measured[scale])
    chosen = max(measured, key=lambda scale: (measured[scale], scale == trained))
    model.prior_scale.data.fill_(chosen)
    return PriorScaleChoice(trained, measured, chosen)
