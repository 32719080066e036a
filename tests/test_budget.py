"""The cost model behind `drafter.budget: auto`."""

import time

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
from spot.tree import DraftTree, State
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

    class Recorder:
        budget = 99

        def propose(self, inputs):
            return [self.budget]

    curve = AcceptanceCurve((0, 1, 3, 7), (1.0, 1.8, 2.6, 3.2))
    auto = AutoBudget(Recorder(), curve, ForwardCost((1, 64), (1.0, 1.0)))
    assert auto.propose([None]) == [7]
    auto = AutoBudget(Recorder(), curve, ForwardCost((1, 64), (1.0, 64.0)))
    assert auto.propose([None, None]) == [0]


def test_auto_budget_counts_the_drafters_own_time():
    class SlowDrafter:
        budget = 99

        def __init__(self, seconds_per_node: float):
            self.seconds_per_node = seconds_per_node

        def propose(self, inputs):
            time.sleep(self.seconds_per_node * self.budget * len(inputs))
            return [self.budget]

    curve = AcceptanceCurve((0, 1, 3, 7), (1.0, 1.8, 2.6, 3.2))
    free_forwards = ForwardCost((1, 64), (0.01, 0.01))
    auto = AutoBudget(SlowDrafter(0.0), curve, free_forwards, probe_calls=2)
    assert [auto.propose([None])[0] for _ in range(3)] == [7, 7, 7]
    auto = AutoBudget(SlowDrafter(0.01), curve, free_forwards, probe_calls=2)
    assert [auto.propose([None])[0] for _ in range(3)] == [7, 7, 0]


def test_drafting_is_priced_per_call_never_cheaper_for_a_smaller_budget():
    measured = DraftingCost(budget=7, batch_size=1, seconds=0.02)
    assert measured(1, 1) == measured(7, 1) == 0.02  # one model call either way
    assert measured(14, 2) == pytest.approx(0.08)  # twice the nodes, twice the requests
    curve = AcceptanceCurve((0, 1, 3, 7), (1.0, 1.8, 2.6, 3.2))
    flat = ForwardCost((1, 64), (0.01, 0.01))
    # per node (0.02 / 7) budget 1 would look best (1.8 / 0.0129); per call it is the worst
    assert choose_budget(curve, flat, 1, measured) == 7  # 3.2 / 0.03 beats 1 / 0.01
    assert choose_budget(curve, flat, 1, DraftingCost(7, 1, 0.03)) == 0  # 3.2 / 0.04 < 100
