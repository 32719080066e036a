"""The speculative benchmark's walk-stop classification on a hand-written tree."""

import importlib.util
import sys
from pathlib import Path

import torch

from spot.tree import DraftTree, Layout, State, advance

M = 11  # mask id
spec = importlib.util.spec_from_file_location(
    "bench_speculative", Path(__file__).parents[1] / "bench" / "speculative.py"
)
bench = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = bench  # dataclasses look their module up there
spec.loader.exec_module(bench)


def test_each_reason_a_walk_stops_is_told_apart():
    lay = Layout.for_prompt(4, 4, 4, 4, False, M, (10,))
    root = State(4, torch.tensor([5, M, M, M]), 1, 1)
    a = advance(lay, root, torch.tensor([5, 7, M, M]))
    b = advance(lay, a, torch.tensor([5, 7, 8, M]))
    tree = DraftTree((root, a, b), (-1, 0, 1))
    at = torch.tensor([False, True, False, False])  # the target commits position 1
    at_3 = torch.tensor([False, False, False, True])

    def stop(path, commits, ended=False):
        return bench.walk_stop(tree, path, commits, ended, M)

    assert bench.walk_stop(DraftTree.single(root), [0], at, False, M) == "no draft"
    assert stop([0], at_3) == "order"  # the only child commits position 1
    assert stop([0], at) == "token"  # it does commit position 1: with another token
    assert stop([0, 1, 2], at_3) == "budget"  # a leaf
    # the target's transition from b completes the request: nothing was left to draft
    assert stop([0, 1, 2], at_3, ended=True) == "end"
    assert stop([0], at, ended=True) == "end"
