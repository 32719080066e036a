"""Learning a drafter from the rows a job decodes: Spiffy first, then SPOT in rounds.

A job decodes its rows anyway, and the decode loop's trace hands over each row's trajectory
(the target's own states and exact logits, with or without a drafter: the forwards it took,
no more). `DrafterLearner` takes those trajectories as they come and:

1. keeps a slice of the rows out of training, chosen by request key: the held-out rows every
   drafter is measured on, and a validation slice that picks SPOT's epoch;
2. counts Spiffy's formula paths as rows arrive and calibrates Spiffy's draft graph as soon
   as `spiffy_rows` rows are in, so a checkpoint without any drafter drafts early;
3. trains SPOT's order model (the `order` objective, docs/benchmarks.md §5.4) when
   `spot_rows[0]` rows are in, and again at each later count (the rows doubling), each round
   starting from the last round's model (Spiffy is recalibrated at each round too);
4. measures each new drafter on the held-out rows by replaying the decode loop over their
   recorded trajectories (`spot.drafters.replay`: the forwards the decoder would take, no
   target forward) beside the drafter in use, hands it out only when it takes fewer
   forwards at the decision budget, and stops after a round whose gain over the last one
   says the next doubling, worth about half as much (§5.4), will not pay.

Each round writes a drafter file in the format its kind's registry entry reads (a job can
name it in `drafter.path`), with the request keys it learned from and its held-out figures.
"""

from __future__ import annotations

import hashlib
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from spot.budget import CURVE_BUDGETS
from spot.drafters.files import save_order_model
from spot.drafters.order_model import OrderModel, OrderModelConfig
from spot.drafters.registry import load_drafter
from spot.drafters.replay import ReplayTarget, replay
from spot.drafters.spiffy import DraftGraph, SpiffyDrafter, count_paths, graph_from_counts
from spot.drafters.spot import SpotDrafter
from spot.drafters.training import root_samples, train_order_model
from spot.drafters.trajectory import Trajectories
from spot.drafting import BudgetedDrafter

SPIFFY, SPOT = "spiffy", "spot"


@dataclass(frozen=True)
class LearnerConfig:
    """When and how the learner learns (the defaults follow docs/benchmarks.md §5.3-5.4)."""

    heldout_percent: int = 10  # of rows (by request key): measures every drafter
    validation_percent: int = 10  # of rows: picks SPOT's epoch
    spiffy_rows: int = 64  # rows before Spiffy's first calibration
    # draft graph paths kept (Spiffy's D): more than the largest budget, so that a tree
    # whose paths reach one state twice drafts the next paths in their place
    spiffy_budget: int = 64
    spiffy_depth: int = 8
    # rows recorded at each SPOT round: the first when the `order` objective starts to pay,
    # then each time the rows double (§5.4: each doubling worth about half the one before)
    spot_rows: tuple[int, ...] = (600, 1200, 2400, 4800, 9600, 19200)
    min_spot_rounds: int = 2  # rounds before the gain may stop the learner
    # a round's relative gain in held-out steps per forward over the previous SPOT round:
    # the next doubling is worth about half of it; below this, the learner stops
    min_gain: float = 0.01
    epochs: int = 6  # the first SPOT round's
    warm_epochs: int = 3  # later rounds', which start from the last round's model
    batch_size: int = 256
    lr: float = 1e-3
    order_model: OrderModelConfig = field(default_factory=OrderModelConfig)
    # SPOT's tree is calibrated by the forwards replayed on the validation rows: its
    # sharpness (the prior scale: the trained one or one of these, as `calibrate-spot` does
    # by decoding), then how many of a position's likeliest tokens a node drafts
    prior_scales: tuple[float, ...] = (2.0, 4.0)
    tree_token_choices: tuple[int, ...] = (1, 2)
    decision_budget: int = 16  # where new drafters are compared (forwards saved)
    budgets: tuple[int, ...] = (2, 16)  # steps per forward reported per round
    replay_rows: int = 400  # held-out rows replayed (the first that arrived)
    seed: int = 0
    device: str = "cpu"  # where SPOT's order model trains ("cuda": the learner's GPU)

    def __post_init__(self):
        if not 0 <= self.heldout_percent + self.validation_percent < 100:
            raise ValueError("heldout_percent + validation_percent must stay below 100")
        if self.decision_budget not in self.budgets:
            raise ValueError(f"decision_budget {self.decision_budget} must be one of budgets")


@dataclass(frozen=True)
class Round:
    """One drafter the learner made and what the held-out rows said of it."""

    number: int
    kind: str  # "spiffy" | "spot"
    path: Path
    rows: int  # rows recorded when it was made
    rows_by_slice: dict[str, int]  # train / validation / held-out rows
    metrics: dict  # held-out figures (SPOT: next-commit accuracy, order log-likelihood)
    before: dict[int, float]  # held-out steps per forward of the drafter in use, by budget
    after: dict[int, float]  # the same for this drafter
    seconds: float  # spent learning and measuring it
    adopted: bool  # it takes fewer forwards at the decision budget than the drafter in use

    def to_dict(self) -> dict:
        return {
            "round": self.number,
            "kind": self.kind,
            "path": str(self.path),
            "rows": self.rows,
            "rows_by_slice": self.rows_by_slice,
            "metrics": self.metrics,
            "steps_per_forward_before": {str(b): v for b, v in self.before.items()},
            "steps_per_forward_after": {str(b): v for b, v in self.after.items()},
            "seconds": self.seconds,
            "adopted": self.adopted,
        }


def slice_of(key: int, config: LearnerConfig) -> str:
    """ "heldout", "validation" or "train": a fixed function of the request key."""
    digest = hashlib.blake2b(int(key).to_bytes(8, "little", signed=True), digest_size=8)
    bucket = int.from_bytes(digest.digest(), "little") % 100
    if bucket < config.heldout_percent:
        return "heldout"
    if bucket < config.heldout_percent + config.validation_percent:
        return "validation"
    return "train"


class DrafterLearner:
    """Learns drafters for one target and decoding from its recorded rows (module doc).

    Drive it with `add` (trajectories as rows finish) and `learn` (whatever is due: None when
    nothing is); `current` is the drafter to hand out, `done` says learning has stopped."""

    def __init__(
        self,
        target: ReplayTarget,
        out_dir: str | Path,
        config: LearnerConfig | None = None,
        model_path: str = "",
        start: OrderModel | None = None,
    ):
        """start: an order model the first SPOT round continues from (a drafter trained for
        the target on other prompts); by default the first round starts untrained."""
        self.target = target
        self.out_dir = Path(out_dir)
        self.config = config or LearnerConfig()
        self.model_path = model_path
        self.meta: dict | None = None
        self.parts: dict[str, list[Trajectories]] = {"train": [], "validation": [], "heldout": []}
        self.keys: dict[str, list[int]] = {"train": [], "validation": [], "heldout": []}
        self.counts: Counter = Counter()  # Spiffy's formula paths over the training rows
        self.counted_records = 0
        self.rounds: list[Round] = []
        self.current: Round | None = None
        self.model: OrderModel | None = start  # the last SPOT round's order model
        self.stopped = False

    # -- taking rows ---------------------------------------------------------------------

    @property
    def rows(self) -> int:
        return sum(len(k) for k in self.keys.values())

    def add(self, traj: Trajectories) -> None:
        """Trajectories of rows the job decoded (any number, each row whole, none twice)."""
        if traj.segment.numel() == 0:
            return
        meta = {k: v for k, v in traj.meta.items() if k != "requests"}
        if self.meta is None:
            self.meta = meta
        elif meta != self.meta:
            raise ValueError("trajectories of one learner share their decoding and target")
        by_slice: dict[str, list[int]] = {"train": [], "validation": [], "heldout": []}
        for key in traj.key.unique().tolist():
            by_slice[slice_of(key, self.config)].append(key)
        for name, keys in by_slice.items():
            if not keys:
                continue
            part = traj.of_requests(keys)
            part = replace(part, meta=part.meta | {"requests": len(keys)})
            self.parts[name].append(part)
            self.keys[name] += keys
            if name == "train":
                self.counts.update(count_paths(part, self.config.spiffy_depth))
                self.counted_records += part.segment.numel()

    # -- deciding -------------------------------------------------------------------------

    @property
    def done(self) -> bool:
        return self.stopped

    def due(self) -> str | None:
        """What `learn` would do now: "spiffy", "spot" or None."""
        c = self.config
        if self.stopped or not self.keys["heldout"]:
            return None
        made = sum(r.kind == SPOT for r in self.rounds)
        if made < len(c.spot_rows) and self.rows >= c.spot_rows[made] and self.keys["validation"]:
            return SPOT
        if not self.rounds and self.rows >= c.spiffy_rows:
            return SPIFFY
        return None

    def learn(self) -> Round | None:
        """Make the drafter that is due (recalibrating Spiffy before each SPOT round), measure
        it on the held-out rows and decide; returns its round (`rounds` has them all)."""
        due = self.due()
        if due is None:
            return None
        if due == SPOT:
            self._round(SPIFFY, self._spiffy)
            return self._round(SPOT, self._spot)
        return self._round(SPIFFY, self._spiffy)

    # -- rounds ---------------------------------------------------------------------------

    def _heldout(self) -> Trajectories:
        return self._joined("heldout")

    def _joined(self, name: str) -> Trajectories:
        parts = self.parts[name]
        if len(parts) > 1:  # keep one part: later rounds join only what came since
            self.parts[name] = parts = [Trajectories.concat(parts)]
        return parts[0]

    def _replayed(self) -> Trajectories:
        """The held-out rows every drafter is replayed on: the first `replay_rows` of them."""
        return self._heldout().of_requests(self.keys["heldout"][: self.config.replay_rows])

    def _steps(self, drafter: BudgetedDrafter | None, held: Trajectories):
        if drafter is None:
            return 1.0, None
        result = replay(drafter, held, self.target)
        return result.steps_per_forward, result

    def _in_use(self, budget: int) -> BudgetedDrafter | None:
        """The drafter handed out, as a job loads it (neither kind reads the target)."""
        r = self.current
        return None if r is None else load_drafter(r.kind, r.path, budget, None)

    def _round(self, kind: str, make) -> Round:
        t0 = time.perf_counter()
        c = self.config
        number = len(self.rounds) + 1
        held = self._replayed()
        drafter_at, save, metrics = make()
        before, after, curve = {}, {}, None
        # loaded outside inference mode: a network's parameters must stay normal tensors
        in_use = {budget: self._in_use(budget) for budget in c.budgets}
        spots = [r for r in self.rounds if r.kind == SPOT]
        last = None
        if kind == SPOT and spots:  # what the rows since the last SPOT round bought
            last = load_drafter(SPOT, spots[-1].path, c.decision_budget, None)
        with torch.inference_mode():
            for budget in c.budgets:
                before[budget], _ = self._steps(in_use[budget], held)
                after[budget], result = self._steps(drafter_at(budget), held)
                if budget == max(c.budgets):
                    curve = result.curve([b for b in CURVE_BUDGETS if b <= budget]).to_dict()
            if last is not None:
                gain = after[c.decision_budget] / self._steps(last, held)[0] - 1
                metrics = metrics | {"gain_over_last_spot": gain}
        adopted = after[c.decision_budget] > before[c.decision_budget]
        learned_from = {name: list(keys) for name, keys in self.keys.items()}
        metrics = metrics | {
            "rows": self.rows,
            "heldout_rows_replayed": len(self.keys["heldout"][: c.replay_rows]),
            "steps_per_forward_before": {str(b): v for b, v in before.items()},
            "steps_per_forward_after": {str(b): v for b, v in after.items()},
        }
        path = (
            self.out_dir
            / f"round-{number:02d}-{kind}.{'json' if kind == SPIFFY else 'safetensors'}"
        )
        save(path, metrics, curve, learned_from)
        rows_by_slice = {name: len(keys) for name, keys in self.keys.items()}
        seconds = time.perf_counter() - t0
        done = Round(
            number, kind, path, self.rows, rows_by_slice, metrics, before, after, seconds, adopted
        )
        self.rounds.append(done)
        if adopted:
            self.current = done
        if kind == SPOT:
            self._decide_to_stop()
        return done

    def _decide_to_stop(self) -> None:
        """Stop after the last scheduled round, or once a round (past `min_spot_rounds`)
        gained so little over the last one, on the same held-out rows, that the next, worth
        about half as much, would gain less than `min_gain`."""
        c = self.config
        spots = [r for r in self.rounds if r.kind == SPOT]
        if len(spots) == len(c.spot_rows):
            self.stopped = True
        elif len(spots) >= max(2, c.min_spot_rounds):
            self.stopped = spots[-1].metrics["gain_over_last_spot"] / 2 < c.min_gain

    def _calibrate_tree(self, model: OrderModel, validation: Trajectories) -> dict:
        """The tree shape whose replay takes the fewest forwards at the decision budget on
        the validation rows: first the prior scale (`model` is left at it; the trained one
        on a tie), then how many token choices a node drafts (`tree_token_choices`, the
        first on a tie). Returns what was measured and chosen."""
        c = self.config
        rows = validation.of_requests(self.keys["validation"][: c.replay_rows])
        trained = float(model.prior_scale.detach())

        def steps(**tree) -> float:
            drafter = SpotDrafter(model, c.decision_budget, **tree)
            return replay(drafter, rows, self.target, False).steps_per_forward

        with torch.inference_mode():
            by_scale = {}
            for scale in (trained, *c.prior_scales):
                model.prior_scale.data.fill_(scale)
                by_scale[scale] = steps()
            chosen = max(by_scale, key=lambda scale: (by_scale[scale], scale == trained))
            model.prior_scale.data.fill_(chosen)
            first = c.tree_token_choices[0]
            by_choices = {first: steps(token_choices=first)}
            for n in c.tree_token_choices[1:]:
                by_choices[n] = steps(token_choices=n)
        choices = max(by_choices, key=lambda n: (by_choices[n], n == first))
        return {
            "budget": c.decision_budget,
            "validation_rows": rows.key.unique().numel(),
            "trained_prior_scale": trained,
            "steps_per_forward_by_prior_scale": {f"{k:.6g}": v for k, v in by_scale.items()},
            "chosen_prior_scale": chosen,
            "steps_per_forward_by_token_choices": {str(k): v for k, v in by_choices.items()},
            "chosen_token_choices": choices,
        }

    def _trained_on(self) -> dict:
        return dict(self.meta or {}) | {"model": self.model_path}

    def _spiffy(self):
        c = self.config
        meta = self._trained_on() | {"records": self.counted_records, "max_depth": c.spiffy_depth}
        graph = graph_from_counts(self.counts, c.spiffy_budget, meta)

        def save(path, metrics, curve, learned_from):
            body = meta | {"learned": {"metrics": metrics, "learned_from": learned_from}}
            DraftGraph(graph.paths, graph.counts, body).save(path)

        return (
            (lambda budget: SpiffyDrafter(graph, budget)),
            save,
            {"records": self.counted_records},
        )

    def _spot(self):
        c = self.config
        config = c.order_model
        train, validation = self._joined("train"), self._joined("validation")
        heldout = self._heldout()
        model, metrics = train_order_model(
            root_samples(train, config),
            root_samples(heldout, config),
            config,
            c.epochs if self.model is None else c.warm_epochs,
            batch_size=c.batch_size,
            lr=c.lr,
            seed=c.seed,
            validation=root_samples(validation, config),
            model=self.model,
            device=c.device,
        )
        metrics["objective"] = "order"
        metrics["warm_start"] = self.model is not None
        calibration = metrics["tree_calibration"] = self._calibrate_tree(model, validation)
        tree = {"token_choices": calibration["chosen_token_choices"]}
        self.model = model

        def save(path, metrics, curve, learned_from):
            header = {
                "trained_on": self._trained_on(),
                "metrics": metrics | {"learned_from": learned_from},
                "acceptance_curve": curve,
                "tree": tree,  # how the registry's loader grows its trees
            }
            save_order_model(path, model, SPOT, header)

        return (lambda budget: SpotDrafter(model, budget, **tree)), save, metrics
