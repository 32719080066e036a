"""The one decode loop: draft-free decoding is speculative decoding with an empty tree.

Per iteration, for every active request (DESIGN §1):
  1. the root is the exact next state (the previous iteration's successor);
  2. the drafter grows a tree of descendant states from the stale logits;
  3. one target forward scores every node of every request's tree;
  4. the commit rule gives each node's exact successor, and the walk accepts drafted nodes
     while they equal the target's own next state.
Requests are batched continuously: up to `max_active` decode at once, each at its own block
and step, and a finished request's place goes to the next waiting one in the same iteration.
Since a request's transitions depend only on its own states, logits and coupled noise, its
output does not depend on which requests share its forwards. A request may bring a stop
check (`Request.stop`), asked after each of its blocks completes: stopping there keeps every
token decoded so far, so a stopped output is the unstopped one up to that block.
On a block-causal target a request's prompt is computed once, as the final prefix of its
first forward; with a prefix cache (`spot.models.prefix_cache`, owned by the caller and
passed in, reused across calls) the prompt's cached whole blocks are not computed at all, and
what requests admitted together share is computed once for all of them (docs/design.md §1.2).
The engine speaks token ids only; it knows nothing of tokenizers or files.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

import torch

from spot.commit import commit_rule
from spot.config import ConfidenceName, DecodingConfig
from spot.drafting import Drafter, DraftInput, StepNoise
from spot.target import PrefixStore, Target, Window
from spot.tree import DraftTree, Layout, State, advance, verify_walk

StopCheck = Callable[[torch.Tensor], bool]
"""Whether a request should end, given its generated ids [G] so far (its completed blocks,
no EOS among them: a block holding one ends the request anyway); called each time one of its
blocks completes. It may keep state between calls (an incremental detokenizer); a request
decoded again from its start calls it again from its first block, with fewer ids."""


@dataclass(frozen=True)
class Request:
    prompt: torch.Tensor  # [P] long token ids
    key: int  # coupled-noise key of this sample (noise.request_key)
    # ends the request after a block for which it returns True (finish reason "stop"): the
    # tokens up to the end of that block are the target's own, the rest EOS-filled
    stop: StopCheck | None = field(default=None, compare=False)


@dataclass
class RequestStats:
    nfe: int = 0  # target forwards this request took part in
    steps: int = 0  # transitions of the target's own decoding
    tree_nodes: int = 0  # states scored, roots included
    drafter_seconds: float = 0.0
    wall_seconds: float = 0.0  # from the request's admission to its end
    # this request's share of those forwards: 1/n of each forward over n requests. Summed
    # over requests it counts the forwards, whatever the batches (`requests_per_forward`)
    forward_share: float = 0.0
    # its prompt's whole blocks on a block-causal target: positions whose KV it took from the
    # prefix cache or from a prefix computed once for it and requests admitted with it (the
    # first of them counts that computation), positions computed in its name, and the time
    # of computing those: the whole of a forward that computes only prompts, and of a forward
    # that also scores states, the share of its tokens that are this prompt's (what a forward
    # costs on a CPU; on a GPU, where a forward's width is nearly free, an upper bound)
    prompt_tokens_reused: int = 0
    prompt_tokens_computed: int = 0
    prefill_seconds: float = 0.0

    @property
    def steps_per_forward(self) -> float:
        return self.steps / self.nfe if self.nfe else 0.0


def requests_per_forward(stats: Iterable[RequestStats]) -> float:
    """Mean number of requests per target forward over the forwards these requests took
    part in (the requests of each forward all among them)."""
    nfe, forwards = 0, 0.0
    for s in stats:
        nfe += s.nfe
        forwards += s.forward_share
    return nfe / forwards if forwards else 0.0


@dataclass(frozen=True)
class Result:
    tokens: torch.Tensor  # [total_length - prompt_length] generated positions, EOS-filled tail
    finish_reason: str  # "eos" | "length" | "stop" (the request's StopCheck ended it)
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
    key: int
    layout: Layout
    context: object
    sequence: torch.Tensor  # [total_length] tokens, positions before the root's origin final
    root: State
    admitted: float  # time.perf_counter() when it began decoding
    stop: StopCheck | None = None
    stopped: bool = False  # its StopCheck ended it after its last completed block
    stale_state: State | None = None
    stale_logits: torch.Tensor | None = None
    stale_hidden: torch.Tensor | None = None
    stats: RequestStats = field(default_factory=RequestStats)

    @property
    def ended(self) -> bool:
        return self.root.done or self.stopped


def generate(
    target: Target,
    requests: Iterable[Request],
    config: DecodingConfig,
    drafter: Drafter | None = None,
    trace: Trace | None = None,
    on_walk: WalkObserver | None = None,
    max_active: int | None = None,
    prefix_cache: PrefixStore | None = None,
) -> list[Result]:
    """Decode `requests`; results in request order. max_active: how many decode at once
    (None: all of them, one batch that shrinks as its requests finish)."""
    results: dict[int, Result] = dict(
        stream(target, requests, config, drafter, trace, on_walk, max_active, prefix_cache)
    )
    return [results[i] for i in range(len(results))]


def stream(
    target: Target,
    requests: Iterable[Request | None],
    config: DecodingConfig,
    drafter: Drafter | None = None,
    trace: Trace | None = None,
    on_walk: WalkObserver | None = None,
    max_active: int | None = None,
    prefix_cache: PrefixStore | None = None,
) -> Iterator[tuple[int, Result]]:
    """Decode `requests` with continuous batching; yields (index in `requests`, result) as
    requests finish. Up to `max_active` requests decode at once (None: all of them); a
    request is taken from `requests` when a place is free, so `requests` may be a generator
    that produces them as they come, for as long as it likes: it may yield None for "nothing
    waiting right now" (the loop goes on with the requests it has and asks again at its next
    iteration; with none active it asks again at once, so a source should then wait for
    work), and the stream ends when `requests` ends and its last request finishes. Indices
    count requests only, not the Nones. prefix_cache: prompt KV to reuse and add to (its
    block length is the config's; the target must take one, see
    `Target.prefix_cache_problem`)."""
    if max_active is not None and max_active < 1:
        raise ValueError(f"max_active must be at least 1, not {max_active}")
    if prefix_cache is not None:
        if target.prefix_cache_problem is not None:
            raise ValueError(f"no prefix cache for this target: {target.prefix_cache_problem}")
        if prefix_cache.block_length != config.block_length:
            raise ValueError(
                f"a prefix cache of block length {prefix_cache.block_length} cannot serve "
                f"block_length {config.block_length}"
            )
    confidence = config.confidence or target.confidence
    hidden = (drafter is not None and drafter.needs_hidden) or getattr(trace, "needs_hidden", False)
    waiting = iter(requests)
    taken, ended = 0, False  # requests taken from `requests`; whether it has ended
    active: list[_Active] = []
    noise = StepNoise(config.seed, config.temperature)  # drafter and commit rule share it
    while True:
        # requests that ended leave, waiting ones take their places
        for a in active:
            if a.ended:
                yield a.index, _finish(a)
        active = [a for a in active if not a.ended]
        admitted = []
        while not ended and (max_active is None or len(active) + len(admitted) < max_active):
            request = next(waiting, _END)
            if request is _END:
                ended = True
            if request is None or request is _END:  # nothing (more) waiting now
                break
            admitted.append(_open(target, taken, request, config, prefix_cache))
            taken += 1
        if prefix_cache is not None and len(admitted) > 1:
            _prefill_shared(target, admitted)
        active += admitted
        if not active:
            if ended:
                return
            continue  # nothing to decode yet: ask the source again
        # 1-2. roots are the last successors; the drafter grows trees from the stale logits
        trees, drafted = _propose(drafter, active, config, confidence, noise)
        # 3. one forward scores every node of every tree
        verify_start = time.perf_counter()
        prompts = _prompt_tokens(target, active, trees)
        scores = _score(target, active, trees, config.block_length, hidden)
        _count_prefill(active, prompts, time.perf_counter() - verify_start)
        # 4. the commit rule's successors, and the walks through the trees
        successors = _successors(active, trees, scores, config, target, confidence, noise)
        verify_seconds = time.perf_counter() - verify_start
        drafted_steps, offset = 0, 0
        for i, (a, tree) in enumerate(zip(active, trees)):
            nodes = len(tree.nodes)
            path = verify_walk(tree, successors[offset : offset + nodes])
            if i in drafted:
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
            a.stats.forward_share += 1 / len(active)
            a.stats.steps += len(path)
            a.stats.tree_nodes += nodes
            a.stale_state = tree.nodes[last]
            a.stale_logits = scores.logits[offset + last]
            a.stale_hidden = None if scores.hidden is None else scores.hidden[offset + last]
            origin = a.root.origin
            a.root = _rebase(a, successors[offset + last])
            if a.stop is not None and not a.root.done and a.root.origin > origin:
                a.stopped = a.stop(a.sequence[a.layout.prompt_length : a.root.origin])
            offset += nodes
        if drafter is not None and drafted:
            drafter.observe_forward(verify_seconds, drafted_steps / len(drafted))
        noise.keep_ahead((a.key, a.root.step) for a in active if not a.ended)


_END = object()  # `requests` has no more


def _open(
    target: Target,
    index: int,
    request: Request,
    config: DecodingConfig,
    prefix_cache: PrefixStore | None,
) -> _Active:
    admitted = time.perf_counter()
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
    if prefix_cache is None:
        context = target.open(prompt, layout.total_length)
    else:
        context = target.open(prompt, layout.total_length, prefix_cache)
    root = State(layout.first_block, layout.initial_block(prompt), 0, 0)
    a = _Active(index, request.key, layout, context, sequence, root, admitted, request.stop)
    if prefix_cache is not None:  # what it found cached
        a.stats.prompt_tokens_reused = target.committed_length(context)
    return a


def _prefill_shared(target: Target, admitted: list[_Active]) -> None:
    """Compute once what the prompts of requests admitted together share beyond the prefix
    cache; the time goes to the requests in whose name it was computed, by token count."""
    before = [target.committed_length(a.context) for a in admitted]
    start = time.perf_counter()
    computed = target.prefill_shared([a.context for a in admitted])
    seconds = time.perf_counter() - start
    total = sum(computed)
    for a, was, own in zip(admitted, before, computed, strict=True):
        gained = target.committed_length(a.context) - was
        a.stats.prompt_tokens_reused += gained - own
        a.stats.prompt_tokens_computed += own
        if total:
            a.stats.prefill_seconds += seconds * own / total


def _prompt_tokens(target: Target, active: list[_Active], trees: list[DraftTree]):
    """Per request, the prompt positions its row of the next forward computes (a block-causal
    target's first forward of a request), and the tokens of all rows of that forward."""
    prompts, tokens = [], 0
    for a, tree in zip(active, trees):
        pending = a.root.origin - target.committed_length(a.context)
        first = target.block_causal and a.stats.nfe == 0
        prompts.append(pending if first else 0)
        tokens += pending + sum(node.span.numel() for node in tree.nodes)
    return prompts, tokens


def _count_prefill(active: list[_Active], prompts, seconds: float) -> None:
    """The prompt positions a forward computed, and its time by their share of its tokens."""
    counts, tokens = prompts
    for a, count in zip(active, counts):
        if count:
            a.stats.prompt_tokens_computed += count
            a.stats.prefill_seconds += seconds * count / tokens


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


def _finish(a: _Active) -> Result:
    """The result of a request whose root ended or that its StopCheck stopped (at the end
    of its completed blocks); its target context is let go (a KV cache of its total length,
    on the target's device)."""
    a.context = None
    layout = a.layout
    end = a.root.origin if a.stopped else a.root.origin + a.root.span.numel()
    tokens = a.sequence[layout.prompt_length :].clone()
    tokens[end - layout.prompt_length :] = layout.eos_ids[0]
    is_eos = torch.isin(tokens[: end - layout.prompt_length], torch.tensor(layout.eos_ids))
    a.stats.wall_seconds = time.perf_counter() - a.admitted
    reason = "stop" if a.stopped else "eos" if bool(is_eos.any()) else "length"
    return Result(tokens, reason, a.stats)


def _propose(
    drafter: Drafter | None,
    active: list[_Active],
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
            active[i].key,
            config,
            confidence,
        )
        for i in drafting
    ]
    t0 = time.perf_counter()
    proposed = drafter.propose(inputs, noise, len(active))
    share = (time.perf_counter() - t0) / len(drafting)
    for i, tree in zip(drafting, proposed, strict=True):
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
        gumbel = [noise.gumbel(a.key, node.step, like) for a, node in owners]
    opening = torch.tensor([a.layout.opening_commit and node.block_step == 0 for a, node in owners])
    next_blocks = commit_rule(
        blocks, scores.logits, gumbel, k, config, target.mask_id, confidence, opening
    ).cpu()
    return [advance(a.layout, node, nb) for (a, node), nb in zip(owners, next_blocks)]
