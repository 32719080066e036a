"""Choosing the draft budget from a cost model: more verified states are not free.

Throughput is steps per second = E[steps per forward | budget D] / cost(forward of the batch's
trees). The first factor is the drafter's measured acceptance curve (stored with the drafter);
the second is measured on this machine for this target at start-up, and the choice it gives
is then checked against neighbouring budgets on the iterations decoded (`AutoBudget`). Budget
0 (draft-free) is a legal outcome.
"""

from __future__ import annotations

import bisect
import statistics
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

from spot.drafting import BudgetedDrafter, Drafter, DraftInput, StepNoise
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
    return fastest(expected_rates(curve, cost, batch_size, drafting), curve.budgets)


def fastest(rate: dict[int, float], budgets: Sequence[int]) -> int:
    """The budget among `budgets` with the most steps per second; the smaller on a tie."""
    return max(budgets, key=lambda d: (rate[d], -d))


def expected_rates(
    curve: AcceptanceCurve,
    cost: ForwardCost,
    batch_size: int,
    drafting: DraftingCost | None = None,
) -> dict[int, float]:
    """Expected steps per second per budget of the curve."""
    return {
        d: s / (cost(batch_size * (d + 1)) + (drafting(d, batch_size) if drafting and d else 0.0))
        for d, s in zip(curve.budgets, curve.steps_per_forward)
    }


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


@dataclass
class _Climb:
    """One batch size's budget search. The budget in use meets its neighbours one at a time;
    the two take turns iteration by iteration until each has `probe_calls` timed iterations,
    so both are timed over the same stretch of decoding (an iteration's cost moves with its
    requests' phase: the forward after a block completes is twice as wide)."""

    in_use: int
    challengers: list[int]  # neighbours still to meet, nearest first
    seconds: dict[int, list[float]] = field(default_factory=dict)  # this meeting's iterations
    drafting: list[float] = field(default_factory=list)  # the first budget's proposals
    probing: bool = True  # timing the first budget alone, for the drafter's own cost
    own: DraftingCost | None = None  # the drafter's time, once probed at a drafting budget
    displaced: int | None = None  # the budget the one in use replaced, until their rematch
    settled: int = 0  # iterations since the last meeting ended

    def next_budget(self) -> int:
        if self.probing or not self.challengers:
            return self.in_use
        rival = self.challengers[0]
        mine, theirs = (len(self.seconds.get(d, ())) for d in (self.in_use, rival))
        return rival if theirs < mine else self.in_use


class AutoBudget(Drafter):
    """Wraps a drafter whose tree size is a budget given per call (`BudgetedDrafter.draft`)
    and picks that budget per batch size from the acceptance curve and what an iteration
    costs; the drafter itself is left as it is.

    The start-up cost curve gives the first budget. Its first `probe_calls` proposals are
    timed and the choice is made again with the drafter's own seconds (`DraftingCost`): a
    drafter slower than the forwards it saves falls to budget 0. From there on the decode loop
    reports each verification's seconds and the steps it advanced (`observe_forward`), and the
    budget in use meets its neighbours on the acceptance curve, one at a time, in turns
    (`_Climb`): the one with more steps per measured second of proposal and verification is
    kept, a new winner meets the budget it replaced once more (four iterations a side can
    crown a slower budget by noise, until the next meeting), and the search goes on from a
    winner until every budget it meets loses: a hill climb over the drafting budgets, with
    draft-free met from each of them, and from draft-free the drafting budget the cost model
    ranks best (`_neighbours`).
    Steps per forward are the curve's, corrected by the steps measured at that budget as they
    accumulate (the curve counts as `prior_iterations` of them: Spiffy's is predicted from its
    calibration counts, and can promise steps a budget does not deliver; docs/benchmarks.md
    §6.2). Every `recheck` iterations the neighbours are met again, to follow a machine that
    speeds up or slows down. A start-up timing disturbed by
    other work then costs a few iterations, not the run."""

    def __init__(
        self,
        drafter: BudgetedDrafter,
        curve: AcceptanceCurve,
        cost: ForwardCost,
        probe_calls: int = 4,
        recheck: int = 256,
        prior_iterations: int = 8,
        margin: float = 0.05,
        clock=time.perf_counter,
    ):
        """margin: how much more steps per second a drafting neighbour must show to replace
        the budget in use (four iterations a side are noisy: where budgets promise within a
        few percent of each other, meetings without it drift between them and lose speed).
        Budget 0 needs no margin: it takes its place back whenever it is faster at all, since
        draft-free speed is the floor drafting must never fall below (with a margin both
        ways, a noisy meeting can keep a slightly slower budget for good; docs/benchmarks.md
        §6.2).
        clock: seconds, for the drafter's own time (tests pass a fake one)."""
        self.drafter = drafter
        self.needs_hidden = drafter.needs_hidden  # SPOT-Sets reads them
        self.curve = curve
        self.cost = cost
        self.probe_calls = probe_calls
        self.recheck = recheck
        self.prior_iterations = prior_iterations
        self.margin = margin
        self.clock = clock
        self.steps = dict(zip(curve.budgets, curve.steps_per_forward))
        self.climbs: dict[int, _Climb] = {}  # per batch-size class (`_class`)
        self.sizes: list[int] = []  # batch sizes seen, in order
        self.timed: Counter = Counter()  # (batch-size class, budget) -> iterations timed
        self.advanced: Counter = Counter()  # (batch-size class, budget) -> steps measured
        self._pending: tuple[int, int, float] | None = None  # proposal awaiting its forward

    @staticmethod
    def _class(n: int) -> int:
        """Batch sizes share a search per power of two (1, 2-3, 4-7, 8-15, ...): a batch
        shrinks as its requests finish, and the sizes of its last few iterations would each
        pay for a search of their own."""
        return n.bit_length()

    @property
    def chosen(self) -> dict[int, int]:
        """The budget in use per batch size seen."""
        return {n: self.climbs[self._class(n)].in_use for n in self.sizes}

    def propose(
        self, inputs: Sequence[DraftInput], noise: StepNoise, batch_size: int
    ) -> list[DraftTree]:
        """The wrapped drafter's trees at the budget in use for `batch_size` requests (or the
        neighbour it is meeting)."""
        n = batch_size
        if n not in self.sizes:
            self.sizes.append(n)
        k = self._class(n)
        if k not in self.climbs:
            self.climbs[k] = _Climb(choose_budget(self.curve, self.cost, n), [])
        budget = self.climbs[k].next_budget()
        start = self.clock()
        trees = self.drafter.draft(inputs, noise, budget)
        self._pending = (n, budget, self.clock() - start)
        return trees

    def observe_forward(self, seconds: float, steps: float) -> None:
        """The decode loop's seconds to verify the trees of the last proposal (the target's
        forward and the commit rule) and the mean steps its requests advanced."""
        if self._pending is None:
            return
        n, budget, drafting = self._pending
        self._pending = None
        k = self._class(n)
        self.timed[k, budget] += 1
        self.advanced[k, budget] += steps
        climb = self.climbs[k]
        if climb.probing:
            climb.drafting.append(drafting)
            if len(climb.drafting) == self.probe_calls:
                if budget:
                    climb.own = DraftingCost(budget, n, statistics.median(climb.drafting))
                climb.in_use = choose_budget(self.curve, self.cost, n, climb.own)
                climb.probing = False
                climb.challengers = self._neighbours(climb, n, climb.in_use)
            return
        if not climb.challengers:
            climb.settled += 1
            if climb.settled >= self.recheck:
                climb.settled = 0
                climb.challengers = self._neighbours(climb, n, climb.in_use)
            return
        climb.seconds.setdefault(budget, []).append(drafting + seconds)
        held, rival = climb.in_use, climb.challengers[0]
        if min(len(climb.seconds.get(d, ())) for d in (held, rival)) < self.probe_calls:
            return
        rate = {d: self._steps(k, d) / statistics.median(climb.seconds[d]) for d in (held, rival)}
        climb.seconds.clear()
        climb.challengers.pop(0)
        rematch, climb.displaced = rival == climb.displaced, None
        margin = self.margin if rival else 0.0
        if rate[rival] > rate[held] * (1 + margin):
            climb.in_use = rival
            onward = [d for d in self._neighbours(climb, n, rival) if d != held]  # not back
            if not rematch:  # one meeting can crown a budget by noise: meet again first
                onward, climb.displaced = [held, *onward], held
            climb.challengers = onward

    def _steps(self, k: int, budget: int) -> float:
        """Steps per forward at `budget` for batch-size class k: the curve's, as if measured
        over `prior_iterations`, pooled with the iterations measured there."""
        prior, measured = self.prior_iterations, self.timed[k, budget]
        return (self.steps[budget] * prior + self.advanced[k, budget]) / (prior + measured)

    def _neighbours(self, climb: _Climb, n: int, budget: int) -> list[int]:
        """The budgets `budget` meets, smaller first. From a drafting budget: draft-free and
        the drafting budgets next to it on the curve. From draft-free: the drafting budget
        the cost model ranks best, not the smallest, with the drafter's measured time priced
        per call at every budget (optimistic for the larger ones; the meeting measures them).
        A drafter's time is mostly per call (SPOT's order model runs once per round), so
        budget 1 can lose to draft-free where 2 beats it, and a climb through 1 never gets
        there (docs/benchmarks.md §6.2)."""
        drafting = [d for d in self.curve.budgets if d]
        if budget == 0:
            per_call = climb.own and replace(climb.own, budget=max(self.curve.budgets))
            rate = expected_rates(self.curve, self.cost, n, per_call)
            return [fastest(rate, drafting)] if drafting else []
        i = drafting.index(budget)
        return [0, *(d for d in drafting[max(0, i - 1) : i + 2] if d != budget)]
