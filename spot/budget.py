"""Choosing the draft budget from a cost model: more verified states are not free.

Throughput is steps per second = E[steps per forward | budget D] / cost(forward of the batch's
trees). The first factor is the drafter's measured acceptance curve (stored with the drafter);
the second is measured on this machine for this target at start-up, then replaced by the
measured cost of the iterations decoded at each budget (`AutoBudget`). Budget 0 (draft-free)
is a legal outcome.
"""

from __future__ import annotations

import bisect
import statistics
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from spot.target import Target, Window
from spot.tree import DraftTree

CURVE_BUDGETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32)  # budgets a stored curve covers


@dataclass(frozen=True)
class AcceptanceCurve:
    """Mean steps advanced per forward when the tree holds the first D drafted nodes."""

    budgets: tuple[int, ...]
    steps_per_forward: tuple[float, ...]

    def to_dict(self) -> dict:
        return {"budgets": list(self.budgets), "steps_per_forward": list(self.steps_per_forward)}

    @classmethod
    def from_dict(cls, d: dict) -> AcceptanceCurve:
        return cls(tuple(d["budgets"]), tuple(float(x) for x in d["steps_per_forward"]))


def acceptance_curve(
    walks: Sequence[tuple[DraftTree, list[int]]], budgets: Sequence[int]
) -> AcceptanceCurve:
    """From walks over trees grown best-first (node index = creation order), the steps each
    smaller budget would have advanced: its tree is the first D drafted nodes."""
    means = []
    for d in budgets:
        total = 0
        for _, path in walks:
            accepted = 0
            for node in path[1:]:
                if node > d:
                    break
                accepted += 1
            total += 1 + accepted
        means.append(total / max(1, len(walks)))
    return AcceptanceCurve(tuple(budgets), tuple(means))


@dataclass(frozen=True)
class ForwardCost:
    """Seconds of one target forward as a function of the states it scores (all requests)."""

    states: tuple[int, ...]
    seconds: tuple[float, ...]

    def __call__(self, states: int) -> float:
        xs, ys = self.states, self.seconds
        if states <= xs[0]:
            return ys[0]
        i = min(bisect.bisect_left(xs, states), len(xs) - 1)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return y0 + (y1 - y0) * (states - x0) / (x1 - x0)  # extrapolates past the last point


def measure_forward_cost(
    target: Target,
    block_length: int,
    prefix_length: int,
    states: Sequence[int],
    repeats: int = 3,
) -> ForwardCost:
    """Time `score` for growing numbers of candidate blocks over one cached prefix; per width
    the median of `repeats` calls after a warm-up, so that a burst of other work on a shared
    machine does not skew the cost curve. (Widths are timed one after another, not in
    interleaved rounds: a narrow forward right after a wide one runs on a colder cache than
    draft-free decoding's back-to-back ones, which made every wider tree look cheaper.)"""
    if prefix_length % block_length:
        raise ValueError("prefix_length must be a multiple of block_length")
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, target.vocab_size, (prefix_length,), generator=g)
    prompt[prompt == target.mask_id] = 0
    context = target.open(prompt, prefix_length + block_length)
    block = torch.full((block_length,), target.mask_id, dtype=torch.long)
    pending = prompt[target.committed_length(context) :]  # not yet final in the context
    first = Window(0, torch.cat([pending, block]), pending.numel())
    _finished(target.score([context], [first], block_length))
    window = block
    seconds = []
    for n in states:
        windows = [Window(0, window.clone()) for _ in range(n)]
        _finished(target.score([context], windows, block_length))  # warm-up
        calls = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            _finished(target.score([context], windows, block_length))
            calls.append(time.perf_counter() - t0)
        seconds.append(statistics.median(calls))
    return ForwardCost(tuple(states), tuple(seconds))


def _finished(scores) -> None:
    """Wait for the forward: on a GPU `score` returns once its kernels are queued, and a
    cost curve of launch times would make every width look free."""
    scores.logits.reshape(-1)[-1].item()


def choose_budget(
    curve: AcceptanceCurve,
    cost: ForwardCost,
    batch_size: int,
    drafting: DraftingCost | None = None,
) -> int:
    """The budget with the most expected steps per second for `batch_size` requests; the
    drafter's own seconds per proposal (`drafting`) come on top of the forward."""
    rate = {
        d: s / (cost(batch_size * (d + 1)) + (drafting(d, batch_size) if drafting and d else 0.0))
        for d, s in zip(curve.budgets, curve.steps_per_forward)
    }
    return max(rate, key=lambda d: (rate[d], -d))


@dataclass(frozen=True)
class DraftingCost:
    """Seconds of one proposal for a batch, measured at one budget. A drafter's time has a
    fixed part per call (its model runs once per round, whatever the round's width), so a
    smaller budget is priced like the measured one (never cheaper) and a larger one in
    proportion to its nodes."""

    budget: int
    batch_size: int
    seconds: float

    def __call__(self, budget: int, batch_size: int) -> float:
        scale = max(1.0, budget / self.budget) * batch_size / self.batch_size
        return self.seconds * scale


class AutoBudget:
    """Wraps a drafter whose `budget` attribute sets its tree size (SPOT) and picks that
    budget per batch size from the acceptance curve and the cost of an iteration.

    The first choice comes from the start-up cost curve. From then on the decode loop reports
    how long each verification took (`observe_forward`), and with the drafter's own seconds
    that is what an iteration at that budget costs on this machine, under this workload.
    After `probe_calls` iterations at a budget its measured cost replaces the prediction, the
    predictions of budgets not yet tried are rescaled by how far the tried ones were off, and
    the choice is made again; the neighbouring budgets of the best one are tried before it is
    kept (a hill climb on measured throughput), so one disturbed start-up timing, or a machine
    faster or slower than at start-up, costs a few iterations instead of the whole run."""

    def __init__(
        self,
        drafter,
        curve: AcceptanceCurve,
        cost: ForwardCost,
        probe_calls: int = 4,
        window: int = 32,
        clock=time.perf_counter,
    ):
        """window: the most recent iterations per (batch size, budget) that its cost is the
        median of. clock: seconds, for the drafter's own time (tests pass a fake one)."""
        if window < probe_calls:
            raise ValueError("window must hold at least probe_calls iterations")
        self.drafter = drafter
        self.needs_hidden = getattr(drafter, "needs_hidden", False)  # SPOT-Sets reads them
        self.curve = curve
        self.cost = cost
        self.probe_calls = probe_calls
        self.window = window
        self.clock = clock
        self.chosen: dict[int, int] = {}
        # (batch size, budget) -> recent iterations as (drafting, verification) seconds
        self.iterations: dict[tuple[int, int], list[tuple[float, float]]] = {}
        self.observed: Counter = Counter()  # (batch size, budget) -> iterations ever timed
        self._pending: tuple[int, int, float] | None = None  # proposal awaiting its forward

    def propose(self, inputs):
        n = len(inputs)
        if n not in self.chosen:
            self.chosen[n] = choose_budget(self.curve, self.cost, n)
        budget = self.chosen[n]
        if self.drafter.budget != budget:  # Spiffy rebuilds its graph on every assignment
            self.drafter.budget = budget
        start = self.clock()
        trees = self.drafter.propose(inputs)
        self._pending = (n, budget, self.clock() - start)
        return trees

    def observe_forward(self, seconds: float) -> None:
        """The decode loop's seconds to verify the trees of the last proposal (the target's
        forward and the commit rule)."""
        if self._pending is None:
            return  # a forward with nothing drafted (every request at a block's start)
        n, budget, drafting = self._pending
        self._pending = None
        samples = self.iterations.setdefault((n, budget), [])
        samples.append((drafting, seconds))
        del samples[: -self.window]
        self.observed[n, budget] += 1
        if self.observed[n, budget] % self.probe_calls == 0:
            self.chosen[n] = self._next_budget(n)

    def _next_budget(self, n: int) -> int:
        """The budget with the most steps per second, measured where tried and predicted
        elsewhere; an untried neighbour of that budget is tried first."""
        measured = {
            d: (
                statistics.median(s for s, _ in self.iterations[n, d]),
                statistics.median(v for _, v in self.iterations[n, d]),
            )
            for d in self.curve.budgets
            if len(self.iterations.get((n, d), ())) >= self.probe_calls
        }
        # how far the start-up curve is off now, from the budgets tried
        scale = statistics.median(v / self.cost(n * (d + 1)) for d, (_, v) in measured.items())
        drafting = next(
            (DraftingCost(d, n, s) for d, (s, _) in sorted(measured.items()) if d), None
        )

        def seconds(d: int) -> float:
            if d in measured:
                return sum(measured[d])
            own = drafting(d, n) if drafting and d else 0.0
            return scale * self.cost(n * (d + 1)) + own

        steps = dict(zip(self.curve.budgets, self.curve.steps_per_forward))
        best = max(steps, key=lambda d: (steps[d] / seconds(d), -d))
        i = self.curve.budgets.index(best)
        neighbours = self.curve.budgets[max(0, i - 1) : i + 2]
        return next((d for d in neighbours if d not in measured), best)
