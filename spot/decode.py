"""The one decode loop: draft-free decoding is speculative decoding with an empty tree.

Per iteration, for every active request of the batch (DESIGN §1):
  1. the root is the exact next state (the previous iteration's successor);
  2. the drafter grows a tree of descendant states from the stale logits;
  3. one target forward scores every node of every request's tree;
  4. the commit rule gives each node's exact successor, and the walk accepts drafted nodes
     while they equal the target's own next state.
The engine speaks token ids only; it knows nothing of tokenizers or files.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from spot.commit import commit_rule
from spot.config import ConfidenceName, DecodingConfig
from spot.drafting import Drafter, DraftInput, StepNoise
from spot.target import Target, Window
from spot.tree import DraftTree, Layout, State, advance, verify_walk


@dataclass(frozen=True)
class Request:
    prompt: torch.Tensor  # [P] long token ids
    key: int  # coupled-noise key of this sample (noise.request_key)


@dataclass
class RequestStats:
    nfe: int = 0  # target forwards this request took part in
    steps: int = 0  # transitions of the target's own decoding
    tree_nodes: int = 0  # states scored, roots included
    drafter_seconds: float = 0.0
    wall_seconds: float = 0.0

    @property
    def steps_per_forward(self) -> float:
        return self.steps / self.nfe if self.nfe else 0.0


@dataclass(frozen=True)
class Result:
    tokens: torch.Tensor  # [total_length - prompt_length] generated positions, EOS-filled tail
    finish_reason: str  # "eos" | "length"
    stats: RequestStats = field(compare=False)


class Trace(Protocol):
    def __call__(
        self,
        index: int,
        state: State,
        logits: torch.Tensor,
        successor: State,
        hidden: torch.Tensor | None,
    ) -> None:
        """Called for every state of the target's own trajectory, in order: request index,
        the state, its exact logits [B, V], its exact successor, and its last hidden states
        [B, H] when the trace has `needs_hidden = True` (else None)."""
        ...


class WalkObserver(Protocol):
    def __call__(self, index: int, tree: DraftTree, path: list[int]) -> None:
        """Called after every verification walk: request index, the scored tree, the
        accepted node indices (root first)."""
        ...


@dataclass
class _Active:
    index: int
    layout: Layout
    context: object
    sequence: torch.Tensor  # [total_length] tokens, positions before the root's origin final
    root: State
    stale_state: State | None = None
    stale_logits: torch.Tensor | None = None
    stale_hidden: torch.Tensor | None = None
    stats: RequestStats = field(default_factory=RequestStats)


def generate(
    target: Target,
    requests: Sequence[Request],
    config: DecodingConfig,
    drafter: Drafter | None = None,
    trace: Trace | None = None,
    on_walk: WalkObserver | None = None,
) -> list[Result]:
    """Decode a batch of requests; finished requests leave the batch."""
    start = time.perf_counter()
    confidence = config.confidence or target.confidence
    hidden = (drafter is not None and drafter.needs_hidden) or getattr(trace, "needs_hidden", False)
    results: list[Result | None] = [None] * len(requests)
    active = [_open(target, i, r, config) for i, r in enumerate(requests)]
    noise = StepNoise(config.seed, config.temperature)  # drafter and commit rule share it
    while active:
        active = [a for a in active if not _finish_if_done(a, results, start)]
        if not active:
            break
        trees, drafted = _propose(drafter, active, requests, config, confidence, noise)
        verify_start = time.perf_counter()
        scores = _score(target, active, trees, config.block_length, hidden)
        successors = _successors(active, trees, scores, requests, config, target, confidence, noise)
        verify_seconds = time.perf_counter() - verify_start
        drafted_steps, asked = 0, set(drafted)
        offset = 0
        for i, (a, tree) in enumerate(zip(active, trees)):
            nodes = len(tree.nodes)
            path = verify_walk(tree, successors[offset : offset + nodes])
            if i in asked:
                drafted_steps += len(path)
            last = path[-1]
            if on_walk is not None:
                on_walk(a.index, tree, path)
            if trace is not None:
                for n in path:
                    h = None if scores.hidden is None else scores.hidden[offset + n]
                    trace(
                        a.index, tree.nodes[n], scores.logits[offset + n], successors[offset + n], h
                    )
            a.stats.nfe += 1
            a.stats.steps += len(path)
            a.stats.tree_nodes += nodes
            a.stale_state = tree.nodes[last]
            a.stale_logits = scores.logits[offset + last]
            a.stale_hidden = None if scores.hidden is None else scores.hidden[offset + last]
            a.root = _rebase(a, successors[offset + last])
            offset += nodes
        if drafter is not None and drafted:
            drafter.observe_forward(verify_seconds, drafted_steps / len(drafted))
        noise.keep_ahead((requests[a.index].key, a.root.step) for a in active if not a.root.done)
    return results  # type: ignore[return-value]


def _open(target: Target, index: int, request: Request, config: DecodingConfig) -> _Active:
    prompt = request.prompt.to(torch.long)
    layout = Layout.for_prompt(
        prompt.numel(),
        config.gen_length,
        config.block_length,
        config.steps_per_block,
        target.absolute_block_grid,
        target.mask_id,
        target.eos_ids,
        target.opening_commit,
    )
    if layout.total_length > target.max_length:
        raise ValueError(
            f"prompt of {prompt.numel()} tokens + generation needs {layout.total_length} "
            f"positions; the target accepts {target.max_length}"
        )
    sequence = torch.full((layout.total_length,), target.mask_id, dtype=torch.long)
    sequence[: prompt.numel()] = prompt
    context = target.open(prompt, layout.total_length)
    root = State(layout.first_block, layout.initial_block(prompt), 0, 0)
    return _Active(index, layout, context, sequence, root)


def _rebase(a: _Active, state: State) -> State:
    """Write the blocks `state` completed into the request's sequence and move its origin to
    its current block, so the next tree's spans hold only that block."""
    b = a.layout.block_length
    end = state.origin + state.span.numel()
    if state.done:
        a.sequence[state.origin : end] = state.span
        return state
    a.sequence[state.origin : end - b] = state.span[:-b]
    return State(end - b, state.span[-b:].clone(), state.step, state.block_step)


def _finish_if_done(a: _Active, results: list[Result | None], start: float) -> bool:
    if not a.root.done:
        return False
    layout = a.layout
    end = a.root.origin + a.root.span.numel()
    tokens = a.sequence[layout.prompt_length :].clone()
    tokens[end - layout.prompt_length :] = layout.eos_ids[0]
    is_eos = torch.isin(tokens[: end - layout.prompt_length], torch.tensor(layout.eos_ids))
    a.stats.wall_seconds = time.perf_counter() - start
    results[a.index] = Result(tokens, "eos" if bool(is_eos.any()) else "length", a.stats)
    return True


def _propose(
    drafter: Drafter | None,
    active: list[_Active],
    requests: Sequence[Request],
    config: DecodingConfig,
    confidence: ConfidenceName,
    noise: StepNoise,
) -> tuple[list[DraftTree], list[int]]:
    """Every request's tree, and the indices of those the drafter proposed for (every request
    past its first forward: the others have no stale logits yet)."""
    trees = [DraftTree.single(a.root) for a in active]
    drafting = [i for i, a in enumerate(active) if a.stale_logits is not None]
    if drafter is None or not drafting:
        return trees, []
    inputs = [
        DraftInput(
            active[i].layout,
            active[i].root,
            active[i].stale_state,
            active[i].stale_logits,
            active[i].stale_hidden,
            requests[active[i].index].key,
            config,
            confidence,
        )
        for i in drafting
    ]
    t0 = time.perf_counter()
    proposed = drafter.propose(inputs, noise, len(active))
    share = (time.perf_counter() - t0) / len(drafting)
    for i, tree in zip(drafting, proposed):
        if not tree.nodes[0].same_as(active[i].root):
            raise ValueError("a drafter must root its tree at the given root")
        trees[i] = tree
        active[i].stats.drafter_seconds += share
    return trees, drafting


def _score(
    target: Target,
    active: list[_Active],
    trees: list[DraftTree],
    block_length: int,
    output_hidden: bool,
):
    windows = []
    for c, (a, tree) in enumerate(zip(active, trees)):
        committed = target.committed_length(a.context)
        prefix = a.sequence[committed : a.root.origin]
        for n, node in enumerate(tree.nodes):
            keep = a.root.origin - committed if n == 0 else 0
            windows.append(Window(c, torch.cat([prefix, node.span]), keep))
    return target.score([a.context for a in active], windows, block_length, output_hidden)


def _successors(
    active: list[_Active],
    trees: list[DraftTree],
    scores,
    requests: Sequence[Request],
    config: DecodingConfig,
    target: Target,
    confidence: ConfidenceName,
    noise: StepNoise,
) -> list[State]:
    """Every scored node's exact next state, in one batched commit-rule call."""
    b = config.block_length
    owners = [(a, node) for a, tree in zip(active, trees) for node in tree.nodes]
    blocks = torch.stack([node.block(b) for _, node in owners])
    k = torch.tensor(
        [a.layout.commit_count(node.block_start(b), node.block_step) for a, node in owners]
    )
    gumbel = None
    if config.temperature > 0.0:
        like = scores.logits[0]  # [B, V]
        gumbel = [noise.gumbel(requests[a.index].key, node.step, like) for a, node in owners]
    opening = torch.tensor([a.layout.opening_commit and node.block_step == 0 for a, node in owners])
    next_blocks = commit_rule(
        blocks, scores.logits, gumbel, k, config, target.mask_id, confidence, opening
    ).cpu()
    return [advance(a.layout, node, nb) for (a, node), nb in zip(owners, next_blocks)]
