"""Spiffy (arXiv 2509.18085), the auto-speculative baseline: drafts from the target's own
stale distribution, shaped by a draft graph calibrated offline.

A draft step is a *formula* (i, j). Static rule (one token per step): commit the i-th most
confident masked position of the current hypothesis (confidence from the stale distribution)
with its j-th ranked token (j=0 is the token the coupled noise picks, the argmax at T=0).
Threshold rule (our extension of the same idea to commit sets): apply the rule to the stale
confidences, then commit the c + i most confident masked positions, where c is the size of the
set the rule picks (i = 0 is the stale thresholded set; negative or positive i shrinks or
grows it); j is always 0. A node of the draft graph is a sequence of formulas from the root.
Calibration counts, over traced draft-free trajectories, how often each formula sequence
reproduces the target's own next steps (every trajectory step adds one to each prefix it
passes through) and keeps the `budget` most frequent prefixes. Optional dynamic pruning keeps,
per request, only the nodes whose drafted tokens have the highest geometric-mean stale
probability.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from spot.budget import AcceptanceCurve
from spot.commit import confidence_order, select_commits
from spot.drafters.rules import SPIFFY_RULES
from spot.drafters.trajectory import Trajectories
from spot.drafting import BudgetedDrafter, DraftInput, StepNoise
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

    def _ranked(self) -> list[int]:
        """Path indices, most frequent first; a path never counts more than its parent, and
        on a tie the shorter comes first, so a parent still comes before its children."""
        return sorted(range(len(self.paths)), key=lambda i: (-self.counts[i], len(self.paths[i])))

    @property
    def paths_by_count(self) -> tuple[Path_, ...]:
        """Its paths, most frequent first (parents before their children)."""
        return tuple(self.paths[i] for i in self._ranked())

    def most_frequent(self, budget: int) -> DraftGraph:
        """The graph calibration would have kept with a smaller budget: its `budget` most
        frequent paths (prefix-closed, since a path never counts more than its parent)."""
        kept = sorted(self._ranked()[:budget])
        return DraftGraph(
            tuple(self.paths[i] for i in kept), tuple(self.counts[i] for i in kept), self.meta
        )

    def acceptance_curve(self, budgets: Sequence[int]) -> AcceptanceCurve:
        """Expected steps per forward at each budget, from the calibration counts: a path's
        count over the records is how often the walk accepts its node (paths of one graph
        draft different transitions, so at most one child of a node can match)."""
        records = int(self.meta["records"])
        ranked = sorted(self.counts, reverse=True)
        steps = tuple(1.0 + sum(ranked[:d]) / records for d in budgets)
        return AcceptanceCurve(tuple(budgets), steps)

    @classmethod
    def load(cls, path: str | Path) -> DraftGraph:
        body = json.loads(Path(path).read_text())
        if body.get("kind") != "spiffy-draft-graph":
            raise ValueError(f"{path} is not a Spiffy draft graph file")
        paths = tuple(tuple((int(i), int(j)) for i, j in p) for p in body["paths"])
        return cls(paths, tuple(body["counts"]), body.get("meta", {}))


def _position_ranks(confidence: torch.Tensor, masked: torch.Tensor) -> torch.Tensor:
    """Masked positions [M] in the commit rules' order (descending confidence)."""
    return confidence_order(confidence.double(), masked)[: int(masked.sum())]


def _threshold_count(confidence: torch.Tensor, masked: torch.Tensor, threshold: float) -> int:
    """Size of the set the threshold rule picks from these confidences."""
    picked = select_commits(
        confidence.double()[None],
        masked[None],
        torch.ones(1, dtype=torch.long),
        "threshold",
        threshold,
    )
    return int(picked.sum())


def _formula(traj: Trajectories, r: int, h: int, rule: str, threshold: float) -> Formula | None:
    """The formula that drafts transition h from record r's stale distribution, if any."""
    committed = traj.committed[h].nonzero().flatten()
    confidence = traj.top_logprobs[r, :, 0].double().exp()
    ranks = _position_ranks(confidence, traj.masked[h])
    if rule == "static":
        pos = int(committed[0])
        hits = (traj.top_ids[r, pos] == traj.tokens[h, pos]).nonzero()
        return (ranks.tolist().index(pos), int(hits[0])) if hits.numel() else None
    size = committed.numel()
    drafted = ranks[:size]
    if set(drafted.tolist()) != set(committed.tolist()):
        return None
    if not bool((traj.top_ids[r, drafted, 0] == traj.tokens[h, drafted]).all()):
        return None
    return (size - _threshold_count(confidence, traj.masked[h], threshold), 0)


def count_paths(traj: Trajectories, max_depth: int = 8) -> Counter[Path_]:
    """How often each formula path reproduces the target's own next steps in `traj`: every
    record adds one to each prefix its following steps pass through. Counts of recordings of
    other requests add up (`Counter.update`), so a learner can count as trajectories come."""
    rule, threshold = traj.meta.get("rule", "static"), float(traj.meta.get("threshold", 1.0))
    if rule not in ("static", "threshold"):
        raise ValueError(f"Spiffy formulas describe the static and threshold rules, not {rule!r}")
    if rule == "static" and int(traj.committed.sum(dim=1).max()) > 1:
        raise ValueError("Spiffy formulas describe one commit per step (tokens_per_step: 1)")
    counts: Counter[Path_] = Counter()
    n = traj.segment.numel()
    for r in range(n):
        path: list[Formula] = []
        for d in range(1, max_depth + 1):
            h = r + d
            if h >= n or traj.segment[h] != traj.segment[r] or not traj.committed[h].any():
                break
            formula = _formula(traj, r, h, rule, threshold)
            if formula is None:
                break
            path.append(formula)
            counts[tuple(path)] += 1
    return counts


def graph_from_counts(counts: Counter[Path_], budget: int, meta: dict) -> DraftGraph:
    """The `budget` most frequent formula paths; meta: the recording's, with `records` (how
    many records were counted) and `max_depth`."""
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], len(kv[0]), kv[0]))[:budget]
    ranked.sort(key=lambda kv: (len(kv[0]), -kv[1], kv[0]))  # parents before children
    return DraftGraph(tuple(p for p, _ in ranked), tuple(c for _, c in ranked), meta)


def calibrate(traj: Trajectories, budget: int, max_depth: int = 8) -> DraftGraph:
    """The `budget` formula paths that most often reproduce the target's own next steps."""
    counts = count_paths(traj, max_depth)
    meta = {"records": traj.segment.numel(), "max_depth": max_depth, **traj.meta}
    return graph_from_counts(counts, budget, meta)


class SpiffyDrafter(BudgetedDrafter):
    """Applies a calibrated draft graph to each root. `budget` drafts that many nodes (all of
    the graph's paths when None), from its most frequent paths down; `keep` enables dynamic
    pruning."""

    rules = SPIFFY_RULES

    def __init__(self, graph: DraftGraph, budget: int | None = None, keep: int | None = None):
        self.calibrated = graph
        self.budget = len(graph.paths) if budget is None else min(budget, len(graph.paths))
        self.keep = keep
        self.ranked = graph.paths_by_count

    def draft(self, inputs: Sequence[DraftInput], noise: StepNoise, budget: int) -> list[DraftTree]:
        return [self._tree(inp, noise, budget) for inp in inputs]

    @property
    def rule(self) -> str:
        return self.calibrated.meta.get("rule", "static")

    def _tree(self, inp: DraftInput, noise: StepNoise, budget: int) -> DraftTree:
        layout = inp.layout
        b = layout.block_length
        root = inp.root
        if root.done or root.block_start(b) != inp.stale_state.block_start(b):
            return DraftTree.single(root)
        config = inp.config
        if config.rule != self.rule or (config.rule == "static" and config.tokens_per_step != 1):
            raise ValueError(
                f"this Spiffy draft graph was calibrated for the {self.rule} rule"
                + (" with 1 token per step" if self.rule == "static" else "")
                + f", not {config.rule} with {config.tokens_per_step} token(s) per step"
            )
        stale_probs = None
        if self.keep is not None:
            stale_probs = torch.softmax(inp.stale_logits.double(), dim=-1)
        ranked_tokens = None
        index: dict[Path_, int] = {(): 0}
        seen = {root.key: 0}  # State.key -> node
        nodes: list[State] = [root]
        parent = [-1]
        log_prob = [0.0]
        drafted = [0]  # tokens drafted from the root
        for path in self.ranked:
            if len(nodes) > budget:
                break
            up = index.get(path[:-1])
            if up is None or nodes[up].done or nodes[up].block_start(b) != root.block_start(b):
                continue
            node = nodes[up]
            block = node.block(b)
            tokens, conf = noise.draw(inp, node.step)
            i, j = path[-1]
            ranks = _position_ranks(conf, block == layout.mask_id)
            if self.rule == "static":
                if i >= ranks.numel():
                    continue
                positions = ranks[i : i + 1]
                if j > 0:  # the j-th ranked stale token other than the drawn one
                    if ranked_tokens is None:
                        ranked_tokens = torch.sort(
                            inp.stale_logits, dim=-1, descending=True, stable=True
                        ).indices
                    pos = int(positions[0])
                    ranked = ranked_tokens[pos, : j + 1].cpu()
                    tokens = tokens.clone()
                    tokens[pos] = ranked[ranked != tokens[pos]][j - 1]
            else:
                size = _threshold_count(conf, block == layout.mask_id, config.threshold) + i
                if not 1 <= size <= ranks.numel():
                    continue
                positions = ranks[:size]
            child_block = block.clone()
            child_block[positions] = tokens[positions]
            child = advance(layout, node, child_block)
            # a state two paths reach (the same commits in another order) is one node: the
            # walk finds it from either (`spot.tree.verify_walk`), and the budget drafts more
            index[path] = seen.setdefault(child.key, len(nodes))
            if index[path] != len(nodes):
                continue
            nodes.append(child)
            parent.append(up)
            if stale_probs is not None:
                at = (positions.to(stale_probs.device), tokens[positions].to(stale_probs.device))
                chosen = stale_probs[at].clamp_min(1e-30).log().sum()
                log_prob.append(log_prob[up] + float(chosen))
                drafted.append(drafted[up] + positions.numel())
        if stale_probs is not None and len(nodes) - 1 > self.keep:
            nodes, parent = _prune(nodes, parent, log_prob, drafted, self.keep)
        return DraftTree(tuple(nodes), tuple(parent))


def _prune(nodes, parent, log_prob, drafted, keep):
    """Keep the `keep` drafted nodes of highest geometric-mean token probability whose
    ancestors are kept too (a pruned node takes its subtree with it)."""
    order = sorted(range(1, len(nodes)), key=lambda n: -log_prob[n] / drafted[n])
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
