"""The cost model behind `drafter.budget: auto`."""

import pytest
import torch

from spot.budget import (
    AcceptanceCurve,
    AutoBudget,
    DraftingCost,
    ForwardCost,
    acceptance_curve,
    choose_budget,
    measure_forward_cost,
)
from spot.config import DecodingConfig
from spot.decode import Request, generate
from spot.drafting import BudgetedDrafter
from spot.tree import DraftTree, State
from tests.random_drafter import RandomDrafter
from tests.toy import ToyTarget


def test_acceptance_curve_truncates_trees_to_their_first_nodes():
    root = State(0, torch.tensor([1]), 0, 0)
    tree = DraftTree((root,) * 5, (-1, 0, 1, 0, 2))
    walks = [(tree, [0, 1, 2, 4]), (tree, [0, 3])]
    curve = acceptance_curve(walks, [0, 1, 2, 3, 4])
    # budget 0: 1 step each; 1: first walk +1; 2: +2; 3: second walk +1; 4: first walk +3
    assert curve.steps_per_forward == (1.0, 1.5, 2.0, 2.5, 3.0)


def test_forward_cost_interpolates_and_extrapolates():
    cost = ForwardCost((1, 2, 4), (1.0, 1.5, 2.5))
    assert cost(1) == 1.0 and cost(3) == 2.0 and cost(8) == 4.5


def test_budget_follows_the_cost_of_width():
    curve = AcceptanceCurve((0, 1, 3, 7), (1.0, 1.8, 2.6, 3.2))
    flat = ForwardCost((1, 64), (1.0, 1.0))  # a GPU-like forward: width is free
    linear = ForwardCost((1, 64), (1.0, 64.0))  # every state costs as much as the first
    assert choose_budget(curve, flat, 1) == 7
    assert choose_budget(curve, linear, 1) == 0
    steep = ForwardCost((1, 2, 4, 8, 64), (1.0, 1.1, 1.5, 3.0, 30.0))
    assert choose_budget(curve, steep, 1) == 3  # 2.6/1.5 beats 1.8/1.1 and 3.2/3.0
    assert choose_budget(curve, steep, 8) == 0


def test_measured_cost_on_a_target_and_auto_budget():
    target = ToyTarget()
    cost = measure_forward_cost(target, block_length=4, prefix_length=8, states=[1, 2, 4])
    assert len(cost.seconds) == 3 and all(s > 0 for s in cost.seconds)

    class Recorder(BudgetedDrafter):
        budget = 99

        def draft(self, inputs, noise, budget):
            return [budget]

    curve = AcceptanceCurve((0, 1, 3, 7), (1.0, 1.8, 2.6, 3.2))
    auto = AutoBudget(Recorder(), curve, ForwardCost((1, 64), (1.0, 1.0)))
    assert auto.propose([None], None, 1) == [7]
    auto = AutoBudget(Recorder(), curve, ForwardCost((1, 64), (1.0, 64.0)))
    assert auto.propose([None, None], None, 2) == [0]
    assert auto.drafter.budget == 99  # chosen per call, never written into the drafter


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class TimedDrafter(BudgetedDrafter):
    """Proposes `budget` as its tree and spends `seconds_per_node` of the fake clock per node
    and request, and `seconds_per_call` per request whenever it drafts (a model run once per
    round, as SPOT's)."""

    budget = 99

    def __init__(
        self, clock: FakeClock, seconds_per_node: float = 0.0, seconds_per_call: float = 0.0
    ):
        self.clock = clock
        self.seconds_per_node = seconds_per_node
        self.seconds_per_call = seconds_per_call

    def draft(self, inputs, noise, budget):
        per_request = self.seconds_per_node * budget
        if budget:
            per_request += self.seconds_per_call
        self.clock.now += per_request * len(inputs)
        return [budget] * len(inputs)


def iterate(auto: AutoBudget, verification, n: int = 1, times: int = 1, steps=None) -> list[int]:
    """Budgets chosen over `times` iterations of n requests whose verification of n * (D + 1)
    states takes verification(states) seconds and advances steps(D) (the curve's by default)."""
    chosen = []
    for _ in range(times):
        [budget, *_] = auto.propose([None] * n, None, n)
        chosen.append(budget)
        advanced = auto.steps[budget] if steps is None else steps(budget)
        auto.observe_forward(verification(n * (budget + 1)), advanced)
    return chosen


CURVE = AcceptanceCurve((0, 1, 3, 7), (1.0, 1.8, 2.6, 3.2))


def test_auto_budget_counts_the_drafters_own_time():
    clock = FakeClock()
    free = ForwardCost((1, 64), (0.01, 0.01))
    auto = AutoBudget(TimedDrafter(clock), CURVE, free, probe_calls=2, clock=clock)
    # probed alone, then met by draft-free and its neighbour in turns; it stays
    assert iterate(auto, free, times=10) == [7, 7] + [7, 0] * 2 + [7, 3] * 2
    auto = AutoBudget(TimedDrafter(clock, 0.01), CURVE, free, probe_calls=2, clock=clock)
    # 7 nodes cost 0.07 s: 3.2 / 0.08 < 1 / 0.01, and drafting is priced per call, never
    # cheaper for a smaller budget, so 0 follows; the drafting budget it meets is the one
    # ranked best at that price, 7, which loses again
    assert iterate(auto, free, times=10) == [7, 7] + [0, 7] * 2 + [0] * 4
    assert auto.chosen == {1: 0}


def test_auto_budget_climbs_past_a_disturbed_start_up_timing():
    """The start-up curve timed 4 states during a burst of other work (4.0 s instead of 1.6):
    budget 3 looks worst. Meeting its neighbours on measured iterations, budget 1 loses to 3,
    3 wins their rematch and beats draft-free and 7 (steps per second: 0 -> 1.0, 1 -> 1.5,
    3 -> 1.63, 7 -> 1.33)."""
    true = ForwardCost((1, 8), (1.0, 2.4))  # 1 + 0.2 per extra state
    disturbed = ForwardCost((1, 2, 4, 8), (1.0, 1.2, 4.0, 2.4))
    assert choose_budget(CURVE, disturbed, 1) == 1  # what the start-up curve alone keeps
    clock = FakeClock()
    auto = AutoBudget(TimedDrafter(clock), CURVE, disturbed, probe_calls=4, clock=clock)
    chosen = iterate(auto, true, times=48)
    assert chosen == (
        [1] * 4 + [1, 0] * 4 + [1, 3] * 4 + [3, 1] * 4 + [3, 0] * 4 + [3, 7] * 4 + [3] * 4
    )
    assert auto.chosen == {1: 3}


def test_auto_budget_compares_budgets_over_the_same_stretch_of_decoding():
    """Iterations 4-19 cost three times as much (forwards after blocks complete are wider):
    timed one after the other, budget 0 (timed before) would beat budget 1 (timed during);
    in turns, both are timed during, and 1 wins as it does outside."""
    curve = AcceptanceCurve((0, 1), (1.0, 1.8))
    startup = ForwardCost((1, 2), (1.0, 2.0))  # budget 0 first: 1 / 1 against 1.8 / 2
    true = ForwardCost((1, 2), (1.0, 1.5))  # 1.8 / 1.5: budget 1 is better
    clock = FakeClock()
    auto = AutoBudget(TimedDrafter(clock), curve, startup, probe_calls=4, clock=clock)
    iteration = iter(range(10**6))

    def verification(states: int) -> float:
        return true(states) * (3 if 4 <= next(iteration) < 20 else 1)

    assert iterate(auto, verification, times=24) == [0] * 4 + [0, 1] * 4 + [1, 0] * 4 + [1] * 4
    assert auto.timed == {(1, 0): 12, (1, 1): 12}


@pytest.mark.parametrize("slowdown", [0.5, 1.0, 2.0, 4.0])
@pytest.mark.parametrize("seconds_per_node", [0.0, 0.02, 0.1])
def test_auto_budget_ends_at_the_best_budget_of_a_machine_faster_or_slower_than_at_start_up(
    slowdown, seconds_per_node
):
    """Forwards cost `slowdown` times the start-up curve, the drafter's time does not change:
    the budget kept is the one with the most steps per second under the true costs."""
    startup = ForwardCost((1, 2, 4, 8), (1.0, 1.3, 2.0, 3.5))
    clock = FakeClock()
    drafter = TimedDrafter(clock, seconds_per_node)
    auto = AutoBudget(drafter, CURVE, startup, probe_calls=2, clock=clock)

    def true_seconds(d: int) -> float:
        return slowdown * startup(d + 1) + seconds_per_node * d

    rate = {d: s / true_seconds(d) for d, s in zip(CURVE.budgets, CURVE.steps_per_forward)}
    chosen = iterate(auto, lambda states: slowdown * startup(states), times=40)
    assert chosen[-20:] == [max(rate, key=rate.get)] * 20


def test_auto_budget_meets_its_neighbours_again_after_recheck_iterations():
    """Settled at budget 0 while forwards were dear (another job on the machine); once they
    are cheap the neighbours are met again and the budget climbs."""
    clock = FakeClock()
    dear = ForwardCost((1, 64), (1.0, 64.0))
    cheap = ForwardCost((1, 64), (1.0, 1.0))
    auto = AutoBudget(TimedDrafter(clock), CURVE, dear, probe_calls=2, recheck=10, clock=clock)
    assert iterate(auto, dear, times=16) == [0, 0] + [0, 1] * 2 + [0] * 10
    chosen = iterate(auto, cheap, times=36)
    # each winner meets the budget it replaced once more, then draft-free, then goes on
    assert (
        chosen
        == (
            [0, 1] * 2 + [1, 0] * 2 + [1, 3] * 2 + [3, 1] * 2 + [3, 0] * 2 + [3, 7] * 2 + [7, 3] * 2
        )
        + [7, 0] * 2
        + [7] * 4
    )


def test_the_decode_loop_reports_each_verification_to_the_drafter():
    target = ToyTarget(seed=2)
    seen = []

    class Observing(RandomDrafter):
        def observe_forward(self, seconds, steps):
            seen.append((seconds, steps))

    config = DecodingConfig(gen_length=16, block_length=4)
    [result] = generate(target, [Request(torch.tensor([1, 2, 3]), 5)], config, Observing())
    # every forward but the first (no stale logits yet: nothing proposed, one step)
    assert len(seen) == result.stats.nfe - 1 and all(s > 0 for s, _ in seen)
    assert 1 + sum(steps for _, steps in seen) == result.stats.steps > result.stats.nfe


def test_drafting_is_priced_per_call_never_cheaper_for_a_smaller_budget():
    measured = DraftingCost(budget=7, batch_size=1, seconds=0.02)
    assert measured(1, 1) == measured(7, 1) == 0.02  # one model call either way
    assert measured(14, 2) == pytest.approx(0.08)  # twice the nodes, twice the requests
    curve = AcceptanceCurve((0, 1, 3, 7), (1.0, 1.8, 2.6, 3.2))
    flat = ForwardCost((1, 64), (0.01, 0.01))
    # per node (0.02 / 7) budget 1 would look best (1.8 / 0.0129); per call it is the worst
    assert choose_budget(curve, flat, 1, measured) == 7  # 3.2 / 0.03 beats 1 / 0.01
    assert choose_budget(curve, flat, 1, DraftingCost(7, 1, 0.03)) == 0  # 3.2 / 0.04 < 100


def test_batch_sizes_of_one_power_of_two_share_a_search():
    clock = FakeClock()
    cost = ForwardCost((1, 64), (1.0, 64.0))  # every state costs as much as the first
    auto = AutoBudget(TimedDrafter(clock), CURVE, cost, probe_calls=2, clock=clock)
    assert iterate(auto, cost, n=7, times=2) == [0, 0]  # probed: its search goes on
    assert iterate(auto, cost, n=5, times=4) == [0, 1, 0, 1]  # meets budget 1, in turns
    assert iterate(auto, cost, n=8, times=2) == [0, 0]  # a search of its own, probing
    assert auto.chosen == {7: 0, 5: 0, 8: 0} and len(auto.climbs) == 2


def test_auto_budget_corrects_an_optimistic_curve_with_the_steps_it_measures():
    """The curve promises 1.8 steps per forward at budget 1, the decoding accepts nothing: by
    the curve budget 1 wins (1.8 / 1.25 against 1 / 1), by the measured steps it loses. Pooled
    with the curve (as 8 iterations of it), the measured steps turn the next meeting."""
    clock = FakeClock()
    cost = ForwardCost((1, 2, 64), (1.0, 1.25, 64.0))
    curve = AcceptanceCurve((0, 1), (1.0, 1.8))
    auto = AutoBudget(TimedDrafter(clock), curve, cost, probe_calls=2, recheck=40, clock=clock)
    chosen = iterate(auto, cost, times=70, steps=lambda budget: 1.0)
    assert chosen[:8] == [1, 1, 1, 0, 1, 0, 1, 1] and chosen[-10:] == [0] * 10
    assert auto._steps(1, 1) == pytest.approx((1.8 * 8 + auto.timed[1, 1]) / (8 + auto.timed[1, 1]))


@pytest.mark.parametrize(("margin", "kept"), [(0.05, 0), (0.0, 1)])
def test_a_neighbour_replaces_the_budget_in_use_only_by_the_margin(margin, kept):
    """Budget 1 is 3% better than 0 (1.03 steps for the same seconds): not enough at a 5%
    margin, enough without one."""
    clock = FakeClock()
    startup = ForwardCost((1, 2), (1.0, 2.0))  # budget 0 first
    same = ForwardCost((1, 2), (1.0, 1.0))
    curve = AcceptanceCurve((0, 1), (1.0, 1.03))
    auto = AutoBudget(TimedDrafter(clock), curve, startup, 2, margin=margin, clock=clock)
    assert iterate(auto, same, times=14)[-4:] == [kept] * 4


def test_draft_free_takes_its_place_back_whenever_it_is_faster():
    """The start-up curve prices budget 1 at the forward of one state, so it starts there;
    budget 1 is in fact 3% slower than draft-free (0.97 steps for the same seconds). Budget 0
    needs no margin to replace it: draft-free speed is the floor."""
    clock = FakeClock()
    startup = ForwardCost((1, 2), (1.0, 1.0))
    same = ForwardCost((1, 2), (1.0, 1.0))
    curve = AcceptanceCurve((0, 1), (1.0, 1.2))
    auto = AutoBudget(TimedDrafter(clock), curve, startup, 2, prior_iterations=0, clock=clock)
    chosen = iterate(auto, same, times=14, steps=lambda budget: 0.97 if budget else 1.0)
    assert chosen == [1, 1] + [1, 0] * 2 + [0, 1] * 2 + [0] * 4  # 0 wins, and the rematch
    assert auto.chosen == {1: 0}


def test_a_budget_crowned_by_one_noisy_meeting_loses_the_rematch():
    """Budget 1 is 3% slower than draft-free, but during their first meeting its iterations
    run 20% faster (noise): it wins, then meets budget 0 again on ordinary iterations and
    gives the place back, instead of keeping it until the next re-check."""
    clock = FakeClock()
    startup = ForwardCost((1, 2), (1.0, 2.0))  # budget 0 first
    curve = AcceptanceCurve((0, 1), (1.0, 1.2))
    auto = AutoBudget(TimedDrafter(clock), curve, startup, 2, prior_iterations=0, clock=clock)
    iteration = iter(range(10**6))

    def verification(states: int) -> float:
        noisy = 2 <= next(iteration) < 6 and states == 2  # budget 1's, in its first meeting
        return 0.8 if noisy else 1.0

    chosen = iterate(auto, verification, times=14, steps=lambda budget: 0.97 if budget else 1.0)
    assert chosen == [0, 0] + [0, 1] * 2 + [1, 0] * 2 + [0] * 4
    assert auto.chosen == {1: 0}


def test_draft_free_meets_the_best_drafting_budget_not_the_smallest():
    """A drafter whose time is per call (0.8 s per round, whatever its width): budget 1 runs
    slower than draft-free (1.8 / 2.0 s), budget 3 faster (2.6 / 2.4 s). The start-up curve
    timed wide forwards slow (4 states 2.0 s for 1.6): it starts at 1, and priced per node
    from there the drafter's time makes every drafting budget lose, so the choice falls to 0.
    From there the search meets 3, the drafting budget ranked best with the drafter priced
    per call, not 1, and keeps it (stepping through 1, it would never get past 1's loss)."""
    clock = FakeClock()
    startup = ForwardCost((1, 2, 4, 8), (1.0, 1.2, 2.0, 3.0))
    true = ForwardCost((1, 8), (1.0, 2.4))  # 1 + 0.2 per extra state
    auto = AutoBudget(TimedDrafter(clock, seconds_per_call=0.8), CURVE, startup, 2, clock=clock)
    chosen = iterate(auto, true, times=30)
    assert chosen[:6] == [1, 1] + [0, 3] * 2  # probed at 1, fell to 0, met 3
    assert chosen[-4:] == [3] * 4 and auto.chosen == {1: 3}


def test_the_search_follows_the_requests_in_the_forward_not_the_ones_drafted_for():
    """Continuous batching: a request admitted in an iteration has no stale logits yet and
    gets no tree, but it is in the forward. Iterations of 8 requests, one in three with a
    newcomer (7 drafted for), share the search of 8: the same budgets as 8 drafted for every
    time, never a search of their own."""
    clock = FakeClock()
    cost = ForwardCost((1, 64), (1.0, 64.0))
    steady = AutoBudget(TimedDrafter(clock), CURVE, cost, probe_calls=2, clock=clock)
    expected = iterate(steady, cost, n=8, times=12)
    auto = AutoBudget(TimedDrafter(clock), CURVE, cost, probe_calls=2, clock=clock)
    chosen = []
    for i in range(12):
        drafted_for = 7 if i % 3 == 0 else 8
        [budget, *_] = auto.propose([None] * drafted_for, None, 8)
        chosen.append(budget)
        auto.observe_forward(cost(8 * (budget + 1)), auto.steps[budget])
    assert chosen == expected and auto.chosen == {8: 0} and len(auto.climbs) == 1
    # as requests finish and none wait, the batch shrinks and the search follows its class
    assert iterate(auto, cost, n=3, times=2) == [0, 0] and auto.chosen == {8: 0, 3: 0}
    assert len(auto.climbs) == 2
