"""Block states, draft trees and the verification walk (docs/design.md §1.6, steps 1-4).

Value types built and consumed by pure functions: a drafter builds a `DraftTree` of states
descending from the root, the target scores every node, and `verify_walk` follows the target's
own transitions through the tree as far as they match a drafted child exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch

from spot.commit import transfer_schedule


@dataclass(frozen=True)
class Layout:
    """Where one request's blocks lie and when it stops.

    Blocks are [s, s + block_length) for s = first_block, first_block + block_length, ... up to
    total_length. With an absolute grid (SDAR, LLaDA2.0) first_block is the start of the block
    holding the end of the prompt, whose prompt positions stay fixed; otherwise it is the end
    of the prompt (LLaDA, Dream).
    """

    prompt_length: int
    total_length: int
    block_length: int
    first_block: int
    steps_per_block: int
    mask_id: int
    eos_ids: tuple[int, ...]
    opening_commit: bool = False  # a block's first transition commits its first position

    @classmethod
    def for_prompt(
        cls,
        prompt_length: int,
        gen_length: int,
        block_length: int,
        steps_per_block: int,
        absolute_grid: bool,
        mask_id: int,
        eos_ids: tuple[int, ...],
        opening_commit: bool = False,
    ) -> Layout:
        if absolute_grid:
            first = prompt_length // block_length * block_length
            total = -(-(prompt_length + gen_length) // block_length) * block_length
        else:
            first = prompt_length
            total = prompt_length + gen_length
        return cls(
            prompt_length,
            total,
            block_length,
            first,
            steps_per_block,
            mask_id,
            eos_ids,
            opening_commit,
        )

    def initial_block(self, prompt: torch.Tensor) -> torch.Tensor:
        """First block state [B]: the prompt's tail (absolute grid) then masks."""
        block = torch.full((self.block_length,), self.mask_id, dtype=torch.long)
        tail = prompt[self.first_block :]
        block[: tail.numel()] = tail
        return block

    def commit_count(self, block_start: int, block_step: int) -> int:
        """Static commit count k at step `block_step` of the block starting at `block_start`.

        The schedule splits the whole block_length over steps_per_block for every block. With
        an absolute grid the prompt's partial first block keeps that schedule, as SDAR's and
        LLaDA2.0's `generate` do, and so finishes in fewer steps (the rule commits at most the
        masked positions); re-splitting its masked count would commit other positions at T=0.
        With an opening commit (Dream) step 0 commits the first position and the schedule
        splits the rest of the block over the following steps.
        """
        if self.opening_commit:
            if block_step == 0:
                return 1
            block_step -= 1
        schedule = self._schedule
        return schedule[block_step] if block_step < len(schedule) else self.block_length

    @cached_property
    def _schedule(self) -> tuple[int, ...]:
        """Commit counts of a block's steps (after the opening commit, when there is one);
        kept, since drafters ask for every node they grow."""
        shared = self.block_length - 1 if self.opening_commit else self.block_length
        return tuple(transfer_schedule(shared, self.steps_per_block))

    def ends_request(self, block_start: int, block: torch.Tensor) -> bool:
        """A fully committed block ends the request if it is the last one or holds an EOS
        among its generated positions."""
        if block_start + self.block_length >= self.total_length:
            return True
        generated = block[max(0, self.prompt_length - block_start) :]
        return bool(torch.isin(generated, torch.tensor(self.eos_ids)).any())


@dataclass(frozen=True)
class State:
    """A request's decoding state relative to an origin.

    span: [W] tokens of positions [origin, origin + W); the last block_length of them are the
      current block (mask_id where still masked), the ones before are blocks completed since
      the origin. W is a multiple of block_length.
    step: transitions taken since the request began (the coupled-noise counter).
    block_step: transitions taken in the current block.
    done: the request ended with this state (its last block is complete).
    """

    origin: int
    span: torch.Tensor
    step: int
    block_step: int
    done: bool = False

    def block(self, block_length: int) -> torch.Tensor:
        return self.span[-block_length:]

    def block_start(self, block_length: int) -> int:
        return self.origin + self.span.numel() - block_length

    def same_as(self, other: State) -> bool:
        return self.key == other.key

    @cached_property
    def key(self) -> tuple:
        """What makes two states one, hashable: one lookup finds a state among a tree's. The
        step counts beside the tokens: the threshold rule reaches one block in different
        numbers of steps, and the next transition depends on the step (its coupled noise,
        the static rule's schedule)."""
        return (self.origin, self.step, self.done, tuple(self.span.tolist()))


def advance(layout: Layout, state: State, next_block: torch.Tensor) -> State:
    """The state after one transition that turned the current block into `next_block` [B].

    A block with no mask left is complete: the request ends there, or the next block starts
    fully masked (block_step 0)."""
    b = layout.block_length
    span = torch.cat([state.span[:-b], next_block])
    if bool((next_block == layout.mask_id).any()):
        return State(state.origin, span, state.step + 1, state.block_step + 1)
    if layout.ends_request(state.block_start(b), next_block):
        return State(state.origin, span, state.step + 1, state.block_step + 1, done=True)
    masks = torch.full((b,), layout.mask_id, dtype=span.dtype)
    return State(state.origin, torch.cat([span, masks]), state.step + 1, 0)


@dataclass(frozen=True)
class DraftTree:
    """Candidate states descending from a root; node 0 is the root, each other node's state is
    its parent's state after one drafted transition. Every node is scored by the target."""

    nodes: tuple[State, ...]
    parent: tuple[int, ...]  # parent[0] == -1

    def __post_init__(self) -> None:
        if len(self.nodes) != len(self.parent) or not self.nodes or self.parent[0] != -1:
            raise ValueError("a draft tree needs a root (parent -1) and one parent per node")
        if any(not 0 <= p < i for i, p in enumerate(self.parent[1:], start=1)):
            raise ValueError("each parent must come before its child")

    @classmethod
    def single(cls, root: State) -> DraftTree:
        return cls((root,), (-1,))

    def children(self, node: int) -> list[int]:
        return [i for i, p in enumerate(self.parent) if p == node]

    def find(self, state: State) -> int | None:
        """The first node whose state is `state`, or None."""
        return self._index.get(state.key)

    @cached_property
    def _index(self) -> dict[tuple, int]:
        index: dict[tuple, int] = {}
        for i, node in enumerate(self.nodes):
            index.setdefault(node.key, i)
        return index


def verify_walk(tree: DraftTree, successor: Sequence[State]) -> list[int]:
    """The accepted path from the root.

    successor[i] is the target's exact next state from node i (from node i's logits and the
    coupled noise of its step). Starting at the root, move to the node equal to the current
    node's successor; stop when there is none. That node is usually a child, but any node
    serves: every node is scored on its own, so a state drafted on another branch (the same
    commits reached in another order) is the target's next state as much as a child would
    be. The next root is successor[path[-1]]; the steps advanced are len(path).
    """
    path = [0]
    if len(tree.nodes) == 1:  # the root alone (draft-free): no state to key and look up
        return path
    while True:
        nxt = successor[path[-1]]
        if nxt.done:
            return path
        match = tree.find(nxt)
        if match is None:
            return path
        path.append(match)
