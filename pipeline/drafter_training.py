"""Commands that make drafters for a target: record its own trajectories, train SPOT or
SPOT-Sets on them, calibrate Spiffy's draft graph; and measure the acceptance curve that
`drafter.budget: auto` needs. They parse options, load files and prompts, and run the
recipes of `spot.drafters.recipes`.

    spot-pipeline record-trajectories --model builtin:sdar-tiny --out traj.pt
    spot-pipeline record-trajectories job.yaml --address http://head:8265 --out /shared/traj
    spot-pipeline train-drafter --kind spot --trajectories traj.pt --model builtin:sdar-tiny \
        --out spot.safetensors
    spot-pipeline calibrate-spiffy --trajectories traj.pt --out spiffy.json
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import click
from click.core import ParameterSource
from tqdm import tqdm

from pipeline.job_options import load_or_exit, plan_or_exit, set_option
from spot.config import CommitRule, DecodingConfig

if TYPE_CHECKING:  # the commands import torch and the recipes when they run, not for --help
    from spot.drafters.trajectory import Trajectories
    from spot.drafting import Drafter
    from spot.target import Target

RECORDED = DecodingConfig(gen_length=64)
"""record-trajectories --model's decoding by default: the core's, with the 64-token
generations the shipped drafters were recorded with."""
DECODING_OPTIONS = (
    "block_length",
    "gen_length",
    "rule",
    "threshold",
    "tokens_per_step",
    "temperature",
    "seed",
)


def decoding_options(f):
    """An option for each of DECODING_OPTIONS, RECORDED's value its default."""
    for name in reversed(DECODING_OPTIONS):
        default = getattr(RECORDED, name)
        kind = click.Choice([rule.value for rule in CommitRule]) if name == "rule" else None
        flag = f"--{name.replace('_', '-')}"
        default = str(default) if kind else default
        f = click.option(flag, type=kind, default=default, show_default=True)(f)
    return f


def _config(kw) -> DecodingConfig:
    return DecodingConfig(**{name: kw[name] for name in DECODING_OPTIONS})


@click.command("record-trajectories")
@click.argument("job_file", required=False, type=click.Path(dir_okay=False))
@set_option
@click.option(
    "--model",
    "model_path",
    default=None,
    help="without a job file: builtin:<name> or checkpoint dir, recorded in this process",
)
@click.option(
    "--out",
    required=True,
    help="with a job file: a folder (or URI) of shard files; without: a recording file (.pt)",
)
@click.option("--prompts", default=400, show_default=True, help="corpus train prompts to use")
@click.option("--batch-size", default=16, show_default=True)
@click.option("--hidden/--no-hidden", default=False, help="also keep hidden states (SPOT-Sets)")
@click.option(
    "--address",
    default=None,
    help="with a job file: Ray cluster (dashboard address) to record on through the Ray Jobs "
    "API; default: $RAY_ADDRESS, else an embedded local Ray.",
)
@click.option("--in-cluster", is_flag=True, hidden=True, help="Run inside a Ray job.")
@decoding_options
def record_command(
    job_file, overrides, model_path, out, prompts, batch_size, hidden, address, in_cluster, **kw
):
    """Run the target's own draft-free decoding and store what drafters learn from.

    With JOB_FILE, its target records its input rows with its decoding, on its replicas (a Ray
    job, on a cluster with --address), one shard file per block of rows in the --out folder;
    a folder that already holds some of them records the rest. Without, --model records
    --prompts prompts of the bundled corpus in this process, into one file."""
    if job_file is None:
        if model_path is None:
            raise click.UsageError("give a JOB_FILE (recorded by its replicas) or --model")
        if overrides or address or in_cluster:
            raise click.UsageError("--set and --address take a JOB_FILE")
        _record_here(model_path, out, prompts, batch_size, hidden, kw)
        return
    ctx = click.get_current_context()
    given = [
        f"--{name.removesuffix('_path').replace('_', '-')}"
        for name in ("model_path", "prompts", "batch_size", *kw)
        if ctx.get_parameter_source(name) == ParameterSource.COMMANDLINE
    ]
    if given:
        raise click.UsageError(
            f"{', '.join(given)}: the job file gives the model, the prompts and the decoding "
            "(override them with --set decoding.KEY=VALUE)"
        )
    # a recording is draft-free: the job's drafter (perhaps the one to be trained) is not read
    job = load_or_exit(job_file, (*overrides, "drafter.kind=none"))
    plan = plan_or_exit(job, job_file)
    from pipeline.locations import Location
    from pipeline.ray_auth import prepare_embedded_ray

    address = None if in_cluster else address or os.environ.get("RAY_ADDRESS")
    if not in_cluster and not address:
        prepare_embedded_ray()  # read by Ray when imported, just below
    from pipeline.recording import record_job
    from pipeline.runner import submit_to_cluster

    out = Location.parse(out).portable
    if os.path.isfile(out):
        raise click.UsageError(f"--out {out} is a file; a job records into a folder of shards")
    if in_cluster:
        record_job(job, plan, out, hidden, ray_address="auto", echo=click.echo)
        return
    if address:
        command = ["record-trajectories", "--out", out, "--hidden" if hidden else "--no-hidden"]
        submit_to_cluster(job, address, click.echo, command)
        return
    record_job(job, plan, out, hidden, echo=click.echo)


def _record_here(model_path, out, prompts, batch_size, hidden, kw) -> None:
    """The single-process recording: bundled corpus prompts, one file."""
    from pipeline.drafter_data import corpus_prompts, encode, load_model_and_tokenizer
    from spot.drafters.recipes import record_trajectories

    config = _config(kw)
    tokenizer, target = load_model_and_tokenizer(model_path)
    requests = encode(tokenizer, corpus_prompts("train", prompts, kw["seed"]))
    batches = math.ceil(len(requests) / batch_size)
    with tqdm(total=batches, desc="recording", unit="batch") as bar:
        traj = record_trajectories(
            target, requests, config, batch_size, hidden, on_batch=lambda: bar.update(1)
        )
    traj.meta["model"] = model_path
    traj.save(out)
    click.echo(f"{traj.segment.numel()} transitions of {len(requests)} requests -> {out}")


def _load_trajectories(path: str) -> Trajectories:
    """A recording file or shard folder; one that cannot be read is a bad --trajectories."""
    from spot.drafters.trajectory import Trajectories

    try:
        return Trajectories.load(path)
    except ValueError as error:
        raise click.BadParameter(str(error), param_hint="--trajectories") from error


_device_option = click.option(
    "--device",
    default="auto",
    show_default=True,
    help="where the target runs: auto (the GPU when there is one), cpu, cuda, cuda:1, ...",
)
_prompts_file_option = click.option(
    "--prompts-file",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="JSON Lines of {id, prompt} to measure on instead of the bundled corpus: prompts like "
    "the job's, which the recording did not use",
)


def _measure_prompts(prompts_file, count, skip, bundled):
    """`count` prompts from --prompts-file (after `skip`), else `bundled()`."""
    from pipeline.drafter_data import file_prompts

    if prompts_file is None:
        return bundled()
    try:
        return file_prompts(prompts_file, count, skip)
    except ValueError as error:
        raise click.BadParameter(str(error), param_hint="--prompts-file") from error


_trajectories_option = click.option(
    "--trajectories",
    required=True,
    type=click.Path(exists=True),
    help="a recording: one file, or a folder of shards (record-trajectories JOB_FILE)",
)


@dataclass(frozen=True)
class TrainingOptions:
    """train-drafter's options for its trainers (None: not given)."""

    epochs: int
    heldout: float
    budget: int  # the tree budget of the drafter whose acceptance curve is measured
    objective: str | None
    adapt_from: str | None


Progress = Callable[[int, int, float], None]


@dataclass(frozen=True)
class Trainer:
    """How train-drafter trains a drafter kind of the registry that holds a network.

    train: (trajectories, target, options, progress) -> the trained network, its metrics and
      a drafter of it for the acceptance curve.
    own_options: options only this kind takes, and what each does (said when another kind
      is given it).
    """

    train: Callable[[Trajectories, Target, TrainingOptions, Progress], tuple[Any, dict, Drafter]]
    own_options: dict[str, str] = field(default_factory=dict)


def _train_spot(traj, target, options: TrainingOptions, progress: Progress):
    from spot.drafters.recipes import train_spot
    from spot.drafters.spot import SpotDrafter

    objective = options.objective or "order"
    model, metrics = train_spot(traj, options.epochs, options.heldout, objective, progress=progress)
    return model, metrics, SpotDrafter(model, options.budget)


def _train_spot_sets(traj, target, options: TrainingOptions, progress: Progress):
    from spot.drafters.recipes import train_spot_sets
    from spot.drafters.registry import load_order_model
    from spot.drafters.spot_sets import SpotSetsDrafter

    if traj.hidden is None:
        raise click.UsageError("SPOT-Sets needs trajectories recorded with --hidden")
    source = None
    if options.adapt_from is not None:
        source, source_header = load_order_model(options.adapt_from, "spot-sets")
    model, metrics = train_spot_sets(
        traj, target.embed, options.epochs, options.heldout, adapt_from=source, progress=progress
    )
    if options.adapt_from is not None:
        adapted = {"path": str(options.adapt_from), "trained_on": source_header["trained_on"]}
        metrics["adapted_from"] = adapted
    return model, metrics, SpotSetsDrafter(model, target.embed, options.budget)


TRAINERS = {
    "spot": Trainer(
        _train_spot, {"objective": "--objective chooses how SPOT's order model learns"}
    ),
    "spot-sets": Trainer(
        _train_spot_sets, {"adapt_from": "--adapt-from adapts SPOT-Sets checkpoints"}
    ),
}
"""A trainer per kind of spot.drafters.registry whose files hold a network."""


def _objective(name: str | None) -> str | None:
    """--objective: None, or a name of the recipes' OBJECTIVES (checked when given, so
    `--help` does not import the recipes)."""
    if name is None:
        return None
    from spot.drafters.recipes import OBJECTIVES

    if name not in OBJECTIVES:
        raise click.BadParameter(
            f"{name!r} is not one of {', '.join(map(repr, sorted(OBJECTIVES)))}"
        )
    return name


@click.command("train-drafter")
@click.option("--kind", type=click.Choice(list(TRAINERS)), default="spot")
@_trajectories_option
@click.option("--out", required=True, type=click.Path(dir_okay=False))
@click.option("--model", "model_path", required=True, help="the target (embeddings, evaluation)")
@click.option("--epochs", default=6, show_default=True)
@click.option("--heldout", default=0.1, show_default=True, help="fraction of blocks held out")
@click.option("--budget", default=16, show_default=True, help="tree budget of the curve run")
@click.option("--eval-prompts", default=40, show_default=True, help="held-out prompts")
@_prompts_file_option
@_device_option
@click.option(
    "--adapt-from",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="spot-sets only: a SPOT-Sets checkpoint trained on another target (any width); "
    "its network is kept frozen and only the two projections from this target's width train",
)
@click.option(
    "--objective",
    default=None,
    callback=lambda ctx, param, name: _objective(name),
    help="spot only: `order` (default; every shipped SPOT drafter), the order of the next 8 "
    "commits from each tree root (what a tree reads its root's scores as; wants more "
    "trajectories); `next`, the next commit from hypotheses 1-8 steps past each stale forward",
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
    prompts_file,
    device,
    adapt_from,
    objective,
):
    """Train the SPOT order model (or the SPOT-Sets set model) on recorded trajectories."""
    from pipeline.drafter_data import corpus_prompts, encode, load_model_and_tokenizer
    from spot.drafters.files import save_order_model
    from spot.drafters.recipes import measure_acceptance, recorded_decoding, trained_on

    options = TrainingOptions(epochs, heldout, budget, objective, adapt_from)
    for name, value in vars(options).items():
        owner = next((k for k, t in TRAINERS.items() if name in t.own_options), None)
        if value is not None and owner not in (None, kind):
            raise click.UsageError(f"{TRAINERS[owner].own_options[name]} (--kind {owner})")
    traj = _load_trajectories(trajectories)
    meta = traj.meta
    evaluation = _measure_prompts(
        prompts_file, eval_prompts, 0, lambda: corpus_prompts("heldout", eval_prompts)
    )
    tokenizer, target = load_model_and_tokenizer(model_path, device=device)
    bar = tqdm(desc=f"training {kind}", unit="step")

    def progress(step, total, loss):
        bar.total = total
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.3f}")

    model, metrics, drafter = TRAINERS[kind].train(traj, target, options, progress)
    bar.close()
    config = recorded_decoding(meta)
    requests = encode(tokenizer, evaluation)
    curve = measure_acceptance(target, drafter, requests, config, batch_size=8)
    header = {
        "trained_on": trained_on(meta, model_path),
        "metrics": metrics,
        "acceptance_curve": curve,
    }
    save_order_model(out, model, kind, header)
    click.echo(json.dumps({"out": out, **metrics, "acceptance_curve": curve}, indent=1))


@click.command("calibrate-spiffy")
@_trajectories_option
@click.option("--out", required=True, type=click.Path(dir_okay=False))
@click.option(
    "--budget",
    default=64,
    show_default=True,
    help="draft graph paths kept (Spiffy's D); a tree takes them from the most frequent down "
    "until the decoding budget's nodes are drafted",
)
@click.option("--depth", default=8, show_default=True)
def calibrate_command(trajectories, out, budget, depth):
    """Calibrate Spiffy's draft graph on traced draft-free trajectories."""
    from spot.drafters.spiffy import calibrate

    graph = calibrate(_load_trajectories(trajectories), budget, depth)
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
@_prompts_file_option
@_device_option
def calibrate_spot_command(
    path, model_path, prior_scales, prompts, budget, eval_prompts, prompts_file, device
):
    """Choose a trained SPOT checkpoint's tree sharpness by measured acceptance.

    Training fits the order model's probabilities to the next commit; the tree grows deeper
    chains from sharper ones. This runs the drafter at `budget` on validation prompts (a
    corpus train stream the trajectories did not use) for the trained prior scale and each
    candidate, keeps the one with the most steps per forward, and rewrites the checkpoint
    with it and its acceptance curve on held-out prompts. With --prompts-file, the first
    `--prompts` rows validate and the next `--eval-prompts` measure the curve."""
    from pipeline.drafter_data import corpus_prompts, encode, load_model_and_tokenizer
    from spot.drafters.files import save_order_model
    from spot.drafters.recipes import choose_prior_scale, measure_acceptance, recorded_decoding
    from spot.drafters.registry import load_order_model
    from spot.drafters.spot import SpotDrafter

    model, header = load_order_model(path, "spot")
    config = recorded_decoding(header["trained_on"])
    # the trajectories took the corpus stream of their decoding seed; validate on the next one
    stream = int(header["trained_on"]["seed"]) + 1
    validation_rows = _measure_prompts(
        prompts_file, prompts, 0, lambda: corpus_prompts("train", prompts, stream)
    )
    evaluation = _measure_prompts(
        prompts_file, eval_prompts, prompts, lambda: corpus_prompts("heldout", eval_prompts)
    )
    tokenizer, target = load_model_and_tokenizer(model_path, device=device)
    validation = encode(tokenizer, validation_rows)
    earlier = header["metrics"].get("tree_calibration", {})  # calibrating again starts over
    choice = choose_prior_scale(
        model,
        target,
        validation,
        config,
        budget,
        prior_scales,
        trained=earlier.get("trained_prior_scale"),
        on_measured=lambda scale, steps: click.echo(
            f"prior scale {scale:.3g}: {steps:.3f} steps per forward"
        ),
    )
    requests = encode(tokenizer, evaluation)
    curve = measure_acceptance(target, SpotDrafter(model, budget), requests, config, 8)
    header["metrics"]["tree_calibration"] = {
        "budget": budget,
        "validation_prompts": prompts,
        "prompts_file": prompts_file,
        "trained_prior_scale": choice.trained,
        "steps_per_forward_by_prior_scale": {f"{k:.6g}": v for k, v in choice.measured.items()},
        "chosen_prior_scale": choice.chosen,
    }
    header["acceptance_curve"] = curve
    body = {k: v for k, v in header.items() if k not in ("kind", "config")}
    save_order_model(path, model, "spot", body)
    click.echo(f"kept prior scale {choice.chosen:.3g} -> {path}")
