"""Spiffy (arXiv 2509.18085), the auto-speculative baseline: drafts from the target's own
stale distribution, shaped by a draft graph calibrated offline.

A draft step is a *formula* (i, j): commit the i-th most confident masked position of the
current hypothesis (confidence from the stale distribution) with its j-th ranked token (j=0 is
the token the coupled noise picks, the argmax at T=0). A node of the draft graph is a sequence
of formulas from the root. Calibration counts, over traced draft-free trajectories, how often
each formula sequence reproduces the target's own next steps (every trajectory step adds one
to each prefix it passes through) and keeps the `budget` most frequent prefixes. Optional
dynamic pruning keeps, per request, only the nodes whose drafted tokens have the highest
geometric-mean stale probability.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from spot.decode import DraftInput
from spot.drafters.trajectory import Trajectories
from spot.tree import DraftTree, State, advance

Formula = tuple[int, int]  # (position rank, token rank)
Path_ = tuple[Formula, ...]


@dataclass(frozen=True)
class DraftGraph:
    """Prefix-closed formula paths, parents before children, with calibration counts."""

    paths: tuple[Path_, ...]
    counts: tuple[int, ...]
    meta: dict

    def save(self, path: str | Path) -> None:
        body = {
            "kind": "spiffy-draft-graph",
            "paths": [[list(f) for f in p] for p in self.paths],
            "counts": list(self.counts),
            "meta": self.meta,
        }
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(body, indent=1))

    @classmethod
    def load(cls, path: str | Path) -> DraftGraph:
        body = json.loads(Path(path).read_text())
        if body.get("kind") != "spiffy-draft-graph":
            raise ValueError(f"{path} is not a Spiffy draft graph file")
        paths = tuple(tuple((int(i), int(j)) for i, j in p) for p in body["paths"])
        return cls(paths, tuple(body["counts"]), body.get("meta", {}))


def _position_ranks(confidence: torch.Tensor, masked: torch.Tensor) -> torch.Tensor:
    """Masked positions ordered by descending confidence, lower index first on ties."""
    score = confidence.double().masked_fill(~masked, float("-inf"))
    order = torch.sort(score, descending=True, stable=True).indices
    return order[: int(masked.sum())]


def calibrate(traj: Trajectories, budget: int, max_depth: int = 8) -> DraftGraph:
    """The `budget` formula paths that most often reproduce the target's own next steps."""
    if int(traj.committed.sum(dim=1).max()) > 1:
        raise ValueError("Spiffy formulas describe one commit per step (tokens_per_step: 1)")
    counts: Counter[Path_] = Counter()
    n = traj.segment.numel()
    for r in range(n):
        path: list[Formula] = []
        for d in range(1, max_depth + 1):
            h = r + d
            if h >= n or traj.segment[h] != traj.segment[r] or not traj.committed[h].any():
                break
            pos = int(traj.committed[h].nonzero()[0])
            ranks = _position_ranks(traj.top_probs[r, :, 0], traj.masked[h]).tolist()
            hits = (traj.top_ids[r, pos] == traj.tokens[h, pos]).nonzero()
            if not hits.numel():
                break
            path.append((ranks.index(pos), int(hits[0])))
            counts[tuple(path)] += 1
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], len(kv[0]), kv[0]))[:budget]
    ranked.sort(key=lambda kv: (len(kv[0]), -kv[1], kv[0]))  # parents before children
    meta = {"records": n, "max_depth": max_depth, **traj.meta}
    return DraftGraph(tuple(p for p, _ in ranked), tuple(c for _, c in ranked), meta)


class SpiffyDrafter:
    """Applies a calibrated draft graph to each root; `keep` enables dynamic pruning."""

    def __init__(self, graph: DraftGraph, keep: int | None = None):
        self.graph = graph
        self.keep = keep

    def propose(self, inputs: Sequence[DraftInput]) -> list[DraftTree]:
        return [self._tree(inp) for inp in inputs]

    def _tree(self, inp: DraftInput) -> DraftTree:
        layout = inp.layout
        b = layout.block_length
        root = inp.root
        if root.done or root.block_start(b) != inp.stale_state.block_start(b):
            return DraftTree.single(root)
        if inp.config.rule != "static" or inp.config.tokens_per_step != 1:
            raise ValueError("the Spiffy drafter serves the static rule with 1 token per step")
        stale_probs = torch.softmax(inp.stale_logits.double(), dim=-1)
        ranked_tokens = torch.sort(stale_probs, dim=-1, descending=True, stable=True).indices
        index: dict[Path_, int] = {(): 0}
        nodes: list[State] = [root]
        parent = [-1]
        log_prob = [0.0]
        depth = [0]
        for path in self.graph.paths:
            up = index.get(path[:-1])
            if up is None or nodes[up].done or nodes[up].block_start(b) != root.block_start(b):
                continue
            node = nodes[up]
            block = node.block(b)
            tokens, conf = inp.draw(node.step)
            i, j = path[-1]
            ranks = _position_ranks(conf, block == layout.mask_id)
            if i >= ranks.numel():
                continue
            pos = int(ranks[i])
            token = tokens[pos]
            if j > 0:  # the j-th ranked stale token other than the drawn one
                token = ranked_tokens[pos][ranked_tokens[pos] != token][j - 1]
            child_block = block.clone()
            child_block[pos] = token
            index[path] = len(nodes)
            nodes.append(advance(layout, node, child_block))
            parent.append(up)
            log_prob.append(log_prob[up] + float(stale_probs[pos, token].clamp_min(1e-30).log()))
            depth.append(depth[up] + 1)
        if self.keep is not None and len(nodes) - 1 > self.keep:
            nodes, parent = _prune(nodes, parent, log_prob, depth, self.keep)
        return DraftTree(tuple(nodes), tuple(parent))


def _prune(nodes, parent, log_prob, depth, keep):
    """Keep the `keep` drafted nodes of highest geometric-mean token probability whose
    ancestors are kept too (a pruned node takes its subtree with it)."""
    order = sorted(range(1, len(nodes)), key=lambda n: -log_prob[n] / depth[n])
    kept = {0}
    for n in order:
        if len(kept) > keep:
            break
        chain, up = [], n
        while up not in kept:
            chain.append(up)
            up = parent[up]
        if len(kept) + len(chain) <= keep + 1:
            kept.update(chain)
    mapping = {old: new for new, old in enumerate(sorted(kept))}
    return (
        [nodes[o] for o in sorted(kept)],
        [-1 if o == 0 else mapping[parent[o]] for o in sorted(kept)],
    )
