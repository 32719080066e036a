"""What a drafter would have saved on recorded trajectories, without the target.

A speculative decode accepts a drafted node exactly when it equals the target's own next state
(docs/design.md §1.6), and the target's own states are what a draft-free recording holds. So
the decode loop can be replayed on a recording: each iteration drafts a tree from the stale
forward's top-k (the recording's; the rest of the distribution spread evenly below it) and
walks it along the recorded transitions. No target forward is run. At T=0 the forwards it
counts are the decoder's own (the tests check every request); at T>0 the commit rule's
tempered confidences depend on the whole vocabulary, of which the recording keeps the
top-k, so a drafter now and then ranks positions otherwise and the count is off by a
forward. This is how a learner measures each new drafter on held-out rows while the job
decodes.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

import torch

from spot.budget import AcceptanceCurve, acceptance_curve
from spot.drafters.recipes import recorded_decoding
from spot.drafting import Drafter, DraftInput, StepNoise
from spot.tree import DraftTree, Layout, State, advance

STOPS = ("no draft", "budget", "order", "token", "end")
UNKNOWN_TOKEN = -1  # prompt positions of a block (the recording keeps only generated tokens)


@dataclass(frozen=True)
class ReplayTarget:
    """What of the target a replay needs beside the recording."""

    mask_id: int
    eos_ids: tuple[int, ...]
    vocab_size: int
    opening_commit: bool = False

    @classmethod
    def of(cls, target) -> ReplayTarget:
        return cls(target.mask_id, tuple(target.eos_ids), target.vocab_size, target.opening_commit)


@dataclass
class Replay:
    """Forwards and steps of a replayed decode, per request, with why each walk stopped."""

    forwards: dict[int, int] = field(default_factory=dict)  # request key -> forwards
    steps: dict[int, int] = field(default_factory=dict)  # request key -> transitions
    stops: Counter = field(default_factory=Counter)
    walks: list[tuple[DraftTree, list[int]]] = field(default_factory=list)

    @property
    def steps_per_forward(self) -> float:
        return sum(self.steps.values()) / max(1, sum(self.forwards.values()))

    def curve(self, budgets) -> AcceptanceCurve:
        """Steps per forward at each budget (each tree's first D drafted nodes), as the
        acceptance curve `drafter.budget: auto` reads."""
        return acceptance_curve(self.walks, budgets)


def stale_logits(top_logprobs: torch.Tensor, top_ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """Logits [B, V] whose softmax has the recorded top-k [B, K] and spreads the mass left
    evenly over the other tokens (never above the k-th: their mean is at most its share)."""
    top = top_logprobs.double()
    k = top.shape[-1]
    left = (-torch.logsumexp(top, dim=-1).exp()).log1p().nan_to_num(nan=-745.0)
    rest = (left.clamp_min(-745.0) - math.log(max(1, vocab - k))).clamp_max(top.min(-1).values)
    logits = rest[:, None].expand(-1, vocab).clone()
    logits.scatter_(-1, top_ids.long(), top)
    return logits.float()


def replay(drafter: Drafter, traj, target: ReplayTarget, keep_walks: bool = True) -> Replay:
    """Replay decoding every request of `traj` (a `Trajectories`) one at a time with
    `drafter` (its own budget). A drafter that reads hidden states needs a recording that
    kept them."""
    if drafter.needs_hidden and traj.hidden is None:
        raise ValueError(
            f"{type(drafter).__name__} reads the target's hidden states; this recording has none"
        )
    traj = traj.canonical()  # each request's records together, in step order
    config = recorded_decoding(traj.meta)
    confidence = traj.meta.get("confidence", "tempered")
    out = Replay()
    keys = traj.key.tolist()
    starts = [0] + [i for i in range(1, len(keys)) if keys[i] != keys[i - 1]] + [len(keys)]
    for s, e in zip(starts[:-1], starts[1:]):
        _replay_request(drafter, traj, s, e, target, config, confidence, out, keep_walks)
    return out


def _true_states(traj, s: int, e: int, layout: Layout) -> list[State]:
    """The target's own state before each record s..e-1 of one request, each block on a grid
    of the request's own blocks (block j at j * B)."""
    b = layout.block_length
    states: list[State] = []
    block_index = -1
    for r in range(s, e):
        if r == s or traj.segment[r] != traj.segment[r - 1]:
            block_index += 1
            block = torch.where(traj.masked[r], layout.mask_id, UNKNOWN_TOKEN).long()
            step, block_step = int(traj.step[r]), int(traj.block_step[r])
            states.append(State(block_index * b, block, step, block_step))
        else:
            states.append(_successor(states, r - 1 - s, layout, traj, s))
    return states


def _replay_request(drafter, traj, s, e, target, config, confidence, out, keep_walks):
    b = traj.block_length
    blocks = int(traj.segment[s:e].unique().numel())
    layout = Layout(
        0,
        blocks * b,
        b,
        0,
        int(traj.meta["steps_per_block"]),
        target.mask_id,
        target.eos_ids,
        target.opening_commit,
    )
    states = _true_states(traj, s, e, layout)
    key = int(traj.key[s])
    noise = StepNoise(config.seed, config.temperature)
    n = e - s
    root, stale = 0, None
    forwards = steps = 0
    while root < n:
        tree = DraftTree.single(states[root])
        if stale is not None:
            inp = DraftInput(
                layout,
                states[root],
                states[stale],
                stale_logits(
                    traj.top_logprobs[s + stale], traj.top_ids[s + stale], target.vocab_size
                ),
                traj.hidden[s + stale] if drafter.needs_hidden else None,
                key,
                config,
                confidence,
            )
            tree = drafter.propose([inp], noise, 1)[0]
        path, node, k = [0], 0, 0
        while True:
            nxt = _successor(states, root + k, layout, traj, s)
            if nxt.done:
                stop = "no draft" if len(tree.nodes) == 1 else "end"
                break
            match = tree.find(nxt)  # as `spot.tree.verify_walk` does
            if match is None:
                stop = walk_stop(tree, node, traj.committed[s + root + k], target.mask_id)
                break
            path.append(match)
            node, k = match, k + 1
        out.stops[stop] += 1
        if keep_walks:
            out.walks.append((tree, path))
        forwards += 1
        steps += k + 1
        stale, root = root + k, root + k + 1
        noise.keep_ahead([(key, states[root].step)] if root < n else [])
    out.forwards[key] = forwards
    out.steps[key] = steps


def _successor(states, i, layout, traj, s) -> State:
    """The target's own state after state i of the request, on the root's grid: the next
    block's first state, when record i completes its block, continues from state i's span."""
    state = states[i]
    b = layout.block_length
    nxt = state.block(b).clone()
    committed = traj.committed[s + i]
    nxt[committed] = traj.tokens[s + i][committed].long()
    return advance(layout, state, nxt)


def walk_stop(tree: DraftTree, node: int, target_commits: torch.Tensor, mask_id: int) -> str:
    """Why a verification walk stopped at `node`, its last accepted node, when the target's
    transition from it did not end the request: the tree was the root alone (no stale logits
    for this block yet), the node was a leaf (budget), no child commits the positions the
    target committed (order), or one does but with other tokens (token).
    target_commits: [B] the positions the target committed from that node."""
    if len(tree.nodes) == 1:
        return "no draft"
    children = tree.children(node)
    if not children:
        return "budget"
    b = target_commits.numel()
    last = tree.nodes[node]
    width = last.span.numel()
    masked = last.block(b) == mask_id
    for c in children:
        drafted = tree.nodes[c].span[width - b : width] != mask_id
        if torch.equal(masked & drafted, target_commits):
            return "token"
    return "order"
