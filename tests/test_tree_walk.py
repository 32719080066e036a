"""The verification walk on hand-written tiny trees with known accepted paths."""

import pytest
import torch

from spot.tree import DraftTree, Layout, State, advance, verify_walk

M = 11  # mask id
EOS = 10


def layout(prompt_length=4, gen_length=8, block_length=4):
    steps = block_length
    return Layout.for_prompt(prompt_length, gen_length, block_length, steps, False, M, (EOS,))


def state(tokens, step=0, block_step=0, origin=4):
    return State(origin, torch.tensor(tokens), step, block_step)


def test_walk_follows_the_matching_branch():
    lay = layout()
    root = state([5, M, M, M], step=1, block_step=1)
    a = advance(lay, root, torch.tensor([5, 7, M, M]))
    b = advance(lay, root, torch.tensor([5, 8, M, M]))
    c = advance(lay, a, torch.tensor([5, 7, 9, M]))
    d = advance(lay, a, torch.tensor([5, 7, M, 2]))
    tree = DraftTree((root, a, b, c, d), (-1, 0, 0, 1, 1))
    successor = [
        advance(lay, root, torch.tensor([5, 7, M, M])),  # == a
        advance(lay, a, torch.tensor([5, 7, M, 2])),  # == d
        advance(lay, b, torch.tensor([5, 8, 1, M])),
        advance(lay, c, torch.tensor([5, 7, 9, 3])),
        advance(lay, d, torch.tensor([5, 7, 6, 2])),
    ]
    assert verify_walk(tree, successor) == [0, 1, 4]
    # the next root is the successor of the last accepted node: block 1 done, block 2 starts
    nxt = successor[4]
    assert nxt.span.tolist() == [5, 7, 6, 2, M, M, M, M]
    assert (nxt.step, nxt.block_step, nxt.done) == (4, 0, False)


def test_walk_takes_a_state_drafted_on_another_branch():
    """The target commits position 1 then 2; the tree drafted {1, 2} only below {2}: every
    node is scored on its own, so that node serves the walk from {1} as well."""
    lay = layout()
    root = state([5, M, M, M], step=1, block_step=1)
    one = advance(lay, root, torch.tensor([5, 7, M, M]))
    two = advance(lay, root, torch.tensor([5, M, 9, M]))
    both = advance(lay, two, torch.tensor([5, 7, 9, M]))
    tree = DraftTree((root, one, two, both), (-1, 0, 0, 2))
    successor = [
        one,
        advance(lay, one, torch.tensor([5, 7, 9, M])),  # == both, drafted below `two`
        advance(lay, two, torch.tensor([5, 8, 9, M])),
        advance(lay, both, torch.tensor([5, 7, 9, 3])),
    ]
    assert verify_walk(tree, successor) == [0, 1, 3]
    # the same block reached in more steps is another state (its next step draws other noise)
    later = State(both.origin, both.span, both.step + 1, both.block_step + 1)
    assert tree.find(later) is None and tree.find(both) == 3


def test_walk_stops_at_root_when_nothing_matches():
    lay = layout()
    root = state([M, M, M, M])
    tree = DraftTree(
        (root, advance(lay, root, torch.tensor([1, M, M, M]))),
        (-1, 0),
    )
    successor = [advance(lay, root, torch.tensor([M, 2, M, M])), None]
    assert verify_walk(tree, successor) == [0]


def test_walk_compares_masks_as_well_as_tokens():
    lay = layout()
    root = state([M, M, M, M])
    two_commits = advance(lay, root, torch.tensor([1, 2, M, M]))
    tree = DraftTree((root, two_commits), (-1, 0))
    successor = [advance(lay, root, torch.tensor([1, M, M, M])), None]
    assert verify_walk(tree, successor) == [0]


def test_walk_crosses_the_end_of_a_block():
    lay = layout()
    root = state([1, 2, 3, M], step=3, block_step=3)
    finished = advance(lay, root, torch.tensor([1, 2, 3, 4]))
    assert finished.span.tolist() == [1, 2, 3, 4, M, M, M, M]
    assert finished.block_start(4) == 8 and finished.block_step == 0
    grandchild = advance(lay, finished, torch.tensor([M, 6, M, M]))
    tree = DraftTree((root, finished, grandchild), (-1, 0, 1))
    successor = [
        advance(lay, root, torch.tensor([1, 2, 3, 4])),
        advance(lay, finished, torch.tensor([M, 6, M, M])),
        advance(lay, grandchild, torch.tensor([5, 6, M, M])),
    ]
    assert verify_walk(tree, successor) == [0, 1, 2]
    assert successor[2].span.tolist() == [1, 2, 3, 4, 5, 6, M, M]


def test_eos_block_ends_the_request_and_the_walk():
    lay = layout()
    root = state([1, EOS, 3, M], step=3, block_step=3)
    done = advance(lay, root, torch.tensor([1, EOS, 3, 4]))
    assert done.done
    tree = DraftTree((root,), (-1,))
    assert verify_walk(tree, [done]) == [0]


def test_last_block_ends_the_request():
    lay = layout()
    last = State(8, torch.tensor([1, 2, 3, M]), 7, 3)
    assert advance(lay, last, torch.tensor([1, 2, 3, 4])).done


def test_absolute_grid_keeps_the_prompt_tail_in_the_first_block():
    lay = Layout.for_prompt(6, 8, 4, 4, True, M, (EOS,))
    assert (lay.first_block, lay.total_length) == (4, 16)
    block = lay.initial_block(torch.tensor([9, 9, 9, 9, 7, 8]))
    assert block.tolist() == [7, 8, M, M]
    # the whole block's schedule, as in SDAR/LLaDA2.0; only two positions are masked
    assert [lay.commit_count(4, s) for s in range(4)] == [1, 1, 1, 1]
    # an EOS inside the prompt tail does not end the request
    assert not lay.ends_request(4, torch.tensor([EOS, 8, 1, 2]))
    assert lay.ends_request(4, torch.tensor([7, 8, EOS, 2]))


def test_tree_rejects_malformed_parents():
    root = state([M, M, M, M])
    with pytest.raises(ValueError):
        DraftTree((root, root), (-1, 1))
    with pytest.raises(ValueError):
        DraftTree((root,), (0,))


def test_opening_commit_schedule_splits_the_rest_of_the_block():
    lay = Layout.for_prompt(4, 8, 4, 2, False, M, (EOS,), opening_commit=True)
    assert [lay.commit_count(4, s) for s in range(3)] == [1, 2, 1]
