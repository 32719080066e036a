"""Commit-order statistics of a decoding trajectory, on hand-written states."""

from __future__ import annotations

import torch

from spot.tree import State
from spot_factory.target_quality import TrajectoryStats

M = 9  # mask id


def _logits(argmax: list[int]) -> torch.Tensor:
    """[B, V=10] logits whose argmax per position is given."""
    logits = torch.zeros(len(argmax), 10)
    logits[torch.arange(len(argmax)), torch.tensor(argmax)] = 5.0
    return logits


def test_leftmost_and_stale_token_accuracy_count_each_step():
    stats = TrajectoryStats(block_length=4, mask_id=M)
    s0 = State(8, torch.tensor([M, M, M, M]), 0, 0)
    s1 = State(8, torch.tensor([M, 5, M, M]), 1, 1)  # not the left-most masked position
    s2 = State(8, torch.tensor([7, 5, M, M]), 2, 2)  # left-most
    s3 = State(8, torch.tensor([7, 5, 1, M]), 3, 3)  # left-most
    s4 = State(8, torch.tensor([7, 5, 1, 2, M, M, M, M]), 4, 0)  # block done, next begins
    stats(0, s0, _logits([7, 5, 3, 3]), s1)
    stats(0, s1, _logits([7, 5, 1, 3]), s2)  # stale argmax at 0 was 7: hit
    stats(0, s2, _logits([7, 5, 1, 2]), s3)  # stale argmax at 2 was 1: hit
    stats(0, s3, _logits([7, 5, 1, 2]), s4)  # stale argmax at 3 was 2: hit
    assert (stats.steps, stats.leftmost) == (4, 3)
    assert (stats.stale_steps, stats.stale_hits) == (3, 3)
    # a new block: no stale distribution of the same block for its first step
    s5 = State(12, torch.tensor([M, M, M, 4]), 5, 1)
    stats(0, State(12, torch.tensor([M, M, M, M]), 4, 0), _logits([0, 0, 0, 4]), s5)
    assert (stats.steps, stats.stale_steps) == (5, 3)
    # the previous step predicted 0 at position 2, the step commits 6 there: a miss
    stats(0, s5, _logits([0, 0, 6, 4]), State(12, torch.tensor([M, M, 6, 4]), 6, 2))
    assert (stats.steps, stats.leftmost, stats.stale_steps, stats.stale_hits) == (6, 3, 4, 3)


def test_requests_are_tracked_apart():
    stats = TrajectoryStats(block_length=2, mask_id=M)
    a0, a1 = State(0, torch.tensor([M, M]), 0, 0), State(0, torch.tensor([3, M]), 1, 1)
    stats(0, a0, _logits([3, 3]), a1)
    stats(1, a0, _logits([3, 4]), a1)
    stats(0, a1, _logits([3, 4]), State(0, torch.tensor([3, 4]), 2, 2, done=True))
    stats(1, a1, _logits([3, 4]), State(0, torch.tensor([3, 4]), 2, 2, done=True))
    assert (stats.steps, stats.leftmost) == (4, 4)
    assert (stats.stale_steps, stats.stale_hits) == (2, 1)  # request 0 missed (3 != 4)
