"""Commands that make drafters for a target: record its own trajectories, train SPOT or
SPOT-Sets on them, calibrate Spiffy's draft graph; and measure the acceptance curve that
`drafter.budget: auto` needs.

    spot-pipeline record-trajectories --model builtin:sdar-tiny --out traj.pt
    spot-pipeline train-drafter --kind spot --trajectories traj.pt --model builtin:sdar-tiny \
        --out spot.safetensors
    spot-pipeline calibrate-spiffy --trajectories traj.pt --out spiffy.json
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import click
import torch
from tqdm import tqdm

from spot.budget import CURVE_BUDGETS, acceptance_curve
from spot.builtin import resolve_builtin
from spot.config import DecodingConfig
from spot.decode import Request, generate
from spot.drafters.files import load_order_model, save_order_model
from spot.drafters.order_model import OrderModelConfig
from spot.drafters.spiffy import calibrate
from spot.drafters.spot import SpotDrafter
from spot.drafters.spot_sets import SetModelConfig, SpotSetsDrafter
from spot.drafters.training import (
    adapt_set_model,
    build_samples,
    root_samples,
    train_order_model,
    train_set_model,
)
from spot.drafters.trajectory import Trajectories, TrajectoryRecorder
from spot.noise import request_key


def load_model_and_tokenizer(path: str, dtype: str = "float32"):
    from pipeline.tokenizer import load_tokenizer
    from spot.models.loading import load_target

    local = resolve_builtin(path) if path.startswith("builtin:") else Path(path)
    tokenizer = load_tokenizer(local)
    return tokenizer, load_target(local, dtype=getattr(torch, dtype))


def corpus_prompts(split: str, count: int, seed: int = 0) -> list[dict]:
    """Prompts of the bundled corpus: the train split, or the shipped held-out file."""
    from spot_factory.corpus import examples, read_jsonl

    if split == "heldout":
        return read_jsonl(resolve_builtin("prompts/heldout.jsonl"))[:count]
    stream = examples(seed, "train")
    return [{"id": f"train-{i}", "prompt": next(stream).prompt} for i in range(count)]


def encode(tokenizer, prompts: Sequence[dict]) -> list[Request]:
    out = []
    for p in prompts:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": p["prompt"]}], add_generation_prompt=True, tokenize=False
        )
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        out.append(Request(torch.tensor(ids), request_key(p["id"])))
    return out


def record(
    target,
    requests: Sequence[Request],
    config: DecodingConfig,
    batch_size: int,
    hidden: bool,
) -> Trajectories:
    recorder = TrajectoryRecorder([], config.block_length, target.mask_id, record_hidden=hidden)
    for s in tqdm(range(0, len(requests), batch_size), desc="recording", unit="batch"):
        batch = requests[s : s + batch_size]
        recorder.keys = [r.key for r in batch]
        generate(target, batch, config, trace=recorder)
    meta = {
        "steps_per_block": config.steps_per_block,
        "block_length": config.block_length,
        "gen_length": config.gen_length,
        "rule": config.rule.value,
        "threshold": config.threshold,
        "temperature": config.temperature,
        "seed": config.seed,
        "confidence": config.confidence or target.confidence,
        "vocab_size": target.vocab_size,
        "hidden_size": target.hidden_size,
        "requests": len(requests),
    }
    return recorder.result(meta)


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


def decoding_options(f):
    for option in reversed(
        [
            click.option("--block-length", default=32, show_default=True),
            click.option("--gen-length", default=128, show_default=True),
            click.option(
                "--rule",
                type=click.Choice(["static", "threshold", "sdar_dynamic"]),
                default="static",
                show_default=True,
            ),
            click.option("--threshold", default=0.9, show_default=True),
            click.option("--tokens-per-step", default=1, show_default=True),
            click.option("--temperature", default=0.0, show_default=True),
            click.option("--seed", default=0, show_default=True),
        ]
    ):
        f = option(f)
    return f


def _config(kw) -> DecodingConfig:
    return DecodingConfig(
        gen_length=kw["gen_length"],
        block_length=kw["block_length"],
        rule=kw["rule"],
        threshold=kw["threshold"],
        tokens_per_step=kw["tokens_per_step"],
        temperature=kw["temperature"],
        seed=kw["seed"],
    )


@click.command("record-trajectories")
@click.option("--model", "model_path", required=True, help="builtin:<name> or checkpoint dir")
@click.option("--out", required=True, type=click.Path(dir_okay=False), help="dataset file (.pt)")
@click.option("--prompts", default=400, show_default=True, help="corpus train prompts to use")
@click.option("--batch-size", default=16, show_default=True)
@click.option("--hidden/--no-hidden", default=False, help="also keep hidden states (SPOT-Sets)")
@decoding_options
def record_command(model_path, out, prompts, batch_size, hidden, **kw):
    """Run the target's own draft-free decoding and store what drafters learn from."""
    config = _config(kw)
    tokenizer, target = load_model_and_tokenizer(model_path)
    requests = encode(tokenizer, corpus_prompts("train", prompts, kw["seed"]))
    traj = record(target, requests, config, batch_size, hidden)
    traj.meta["model"] = model_path
    traj.save(out)
    click.echo(f"{traj.segment.numel()} transitions of {len(requests)} requests -> {out}")


@click.command("train-drafter")
@click.option("--kind", type=click.Choice(["spot", "spot-sets"]), default="spot")
@click.option("--trajectories", required=True, type=click.Path(exists=True, dir_okay=False))
@click.option("--out", required=True, type=click.Path(dir_okay=False))
@click.option("--model", "model_path", required=True, help="the target (embeddings, evaluation)")
@click.option("--epochs", default=6, show_default=True)
@click.option("--heldout", default=0.1, show_default=True, help="fraction of blocks held out")
@click.option("--budget", default=16, show_default=True, help="tree budget of the curve run")
@click.option("--eval-prompts", default=40, show_default=True, help="held-out prompts")
@click.option(
    "--adapt-from",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="spot-sets only: a SPOT-Sets checkpoint trained on another target (any width); "
    "its network is kept frozen and only the two projections from this target's width train",
)
@click.option(
    "--objective",
    type=click.Choice(["next", "order"]),
    default="next",
    show_default=True,
    help="spot only: `next`, the next commit from hypotheses 1-8 steps past each stale "
    "forward; `order`, the order of the next 8 commits from each tree root (what a tree "
    "reads its root's scores as; wants more trajectories)",
)
def train_command(
    kind,
    trajectories,
    out,
    model_path,
    epochs,
    heldout,
    budget,
    eval_prompts,
    adapt_from,
    objective,
):
    """Train the SPOT order model (or the SPOT-Sets set model) on recorded trajectories."""
    if adapt_from is not None and kind != "spot-sets":
        raise click.UsageError("--adapt-from adapts SPOT-Sets checkpoints (--kind spot-sets)")
    if objective != "next" and kind != "spot":
        raise click.UsageError("--objective chooses how SPOT's order model learns (--kind spot)")
    traj = Trajectories.load(trajectories)
    meta = traj.meta
    tokenizer, target = load_model_and_tokenizer(model_path)
    train, held = traj.split(heldout)
    train, validation = train.split(heldout)  # picks the epoch; `held` only reports
    bar = tqdm(desc=f"training {kind}", unit="step")

    def progress(step, total, loss):
        bar.total = total
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.3f}")

    if kind == "spot":
        cfg = OrderModelConfig()
        samples = {"next": build_samples, "order": root_samples}[objective]
        model, metrics = train_order_model(
            samples(train, cfg),
            samples(held, cfg),
            cfg,
            epochs,
            progress=progress,
            validation=samples(validation, cfg),
        )
        metrics["objective"] = objective
        drafter = SpotDrafter(model, budget)
    else:
        if traj.hidden is None:
            raise click.UsageError("SPOT-Sets needs trajectories recorded with --hidden")
        cfg = SetModelConfig(target_hidden_size=int(meta["hidden_size"]))
        start = None
        if adapt_from is not None:
            source, source_header = load_order_model(adapt_from, "spot-sets")
            start = adapt_set_model(source, int(meta["hidden_size"]))
            cfg = start.config
            adapted = {"path": str(adapt_from), "trained_on": source_header["trained_on"]}
        model, metrics = train_set_model(
            build_samples(train, cfg),
            build_samples(held, cfg),
            train.hidden,
            held.hidden,
            target.embed,
            cfg,
            epochs,
            progress=progress,
            validation=(build_samples(validation, cfg), validation.hidden),
            model=start,
        )
        if adapt_from is not None:
            metrics["adapted_from"] = adapted
        drafter = SpotSetsDrafter(model, target.embed, budget)
    bar.close()
    config = recorded_decoding(meta)
    requests = encode(tokenizer, corpus_prompts("heldout", eval_prompts))
    curve = measure_acceptance(target, drafter, requests, config, batch_size=8)
    header = {
        "trained_on": trained_on(meta, model_path),
        "metrics": metrics,
        "acceptance_curve": curve,
    }
    save_order_model(out, model, kind, header)
    click.echo(json.dumps({"out": out, **metrics, "acceptance_curve": curve}, indent=1))


@click.command("calibrate-spiffy")
@click.option("--trajectories", required=True, type=click.Path(exists=True, dir_okay=False))
@click.option("--out", required=True, type=click.Path(dir_okay=False))
@click.option("--budget", default=16, show_default=True, help="draft graph nodes (Spiffy's D)")
@click.option("--depth", default=8, show_default=True)
def calibrate_command(trajectories, out, budget, depth):
    """Calibrate Spiffy's draft graph on traced draft-free trajectories."""
    graph = calibrate(Trajectories.load(trajectories), budget, depth)
    graph.save(out)
    click.echo(f"{len(graph.paths)} nodes, deepest {max(map(len, graph.paths))} -> {out}")


def _positive_numbers(ctx, param, text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or any(v <= 0 for v in values):
        raise click.BadParameter(f"expected positive numbers separated by commas, not {text!r}")
    return values


@click.command("calibrate-spot")
@click.option("--drafter", "path", required=True, type=click.Path(exists=True, dir_okay=False))
@click.option("--model", "model_path", required=True, help="the target it was trained for")
@click.option(
    "--prior-scales",
    default="2,4,8",
    show_default=True,
    callback=_positive_numbers,
    help="candidate sharpnesses of the rule's guess under the learned correction, beside "
    "the trained one",
)
@click.option("--prompts", default=24, show_default=True, help="validation prompts")
@click.option("--budget", default=16, show_default=True, help="tree budget to calibrate at")
@click.option("--eval-prompts", default=40, show_default=True, help="held-out prompts")
def calibrate_spot_command(path, model_path, prior_scales, prompts, budget, eval_prompts):
    """Choose a trained SPOT checkpoint's tree sharpness by measured acceptance.

    Training fits the order model's probabilities to the next commit; the tree grows deeper
    chains from sharper ones. This runs the drafter at `budget` on validation prompts (a
    corpus train stream the trajectories did not use) for the trained prior scale and each
    candidate, keeps the one with the most steps per forward, and rewrites the checkpoint
    with it and its acceptance curve on held-out prompts."""
    model, header = load_order_model(path, "spot")
    tokenizer, target = load_model_and_tokenizer(model_path)
    config = recorded_decoding(header["trained_on"])
    # the trajectories took the corpus stream of their decoding seed; validate on the next one
    stream = int(header["trained_on"]["seed"]) + 1
    validation = encode(tokenizer, corpus_prompts("train", prompts, stream))
    earlier = header["metrics"].get("tree_calibration", {})  # calibrating again starts over
    trained = float(earlier.get("trained_prior_scale", model.prior_scale.detach()))
    measured = {}
    for scale in [trained, *prior_scales]:
        model.prior_scale.data.fill_(scale)
        drafter = SpotDrafter(model, budget)
        curve = measure_acceptance(target, drafter, validation, config, batch_size=8)
        measured[scale] = curve["steps_per_forward"][-1]
        click.echo(f"prior scale {scale:.3g}: {measured[scale]:.3f} steps per forward")
    chosen = max(measured, key=lambda scale: (measured[scale], scale == trained))
    model.prior_scale.data.fill_(chosen)
    requests = encode(tokenizer, corpus_prompts("heldout", eval_prompts))
    curve = measure_acceptance(target, SpotDrafter(model, budget), requests, config, 8)
    header["metrics"]["tree_calibration"] = {
        "budget": budget,
        "validation_prompts": prompts,
        "trained_prior_scale": trained,
        "steps_per_forward_by_prior_scale": {f"{k:.6g}": v for k, v in measured.items()},
        "chosen_prior_scale": chosen,
    }
    header["acceptance_curve"] = curve
    body = {k: v for k, v in header.items() if k not in ("kind", "config")}
    save_order_model(path, model, "spot", body)
    click.echo(f"kept prior scale {chosen:.3g} -> {path}")
