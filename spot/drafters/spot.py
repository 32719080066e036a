"""The SPOT drafters: grow a tree of block states from a learned model's predictions.

Best-first under a node budget: a candidate is (parent node, the positions it commits next),
scored by the product along its path of the model's probability and the drafted tokens' stale
probabilities. SPOT's order model proposes single next positions (static rule); SPOT-Sets
proposes whole commit sets (threshold rule). Drafted tokens come from the stale logits under
the coupled noise of the step they would be committed at, so at T>0 they match the target's
own draw whenever its distribution has not moved. Expansion runs in rounds so that the model
is evaluated on all new nodes of all requests in one batch; SPOT evaluates only the roots
(one batched call per proposal) and ranks each tree from its root's scores.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from spot.commit import confidence_order
from spot.drafters.order_model import (
    OrderModel,
    noisy_confidence,
    order_features,
    stale_top,
)
from spot.drafters.rules import SPOT_RULES
from spot.drafting import BudgetedDrafter, DraftInput, StepNoise
from spot.tree import DraftTree, State, advance


@dataclass
class _Growing:
    """One request's tree while it grows."""

    inp: DraftInput
    noise: StepNoise  # the decode run's, shared with the commit rule
    top_logprobs: torch.Tensor  # [B, K]
    top_ids: torch.Tensor  # [B, K]
    stale_masked: torch.Tensor  # [B]
    nodes: list[State]
    parent: list[int]
    score: list[float]
    masked: list[list[bool]]  # per node: which block positions are still masked
    # (-priority, tie-break, parent, positions, token choice, score before the tokens)
    heap: list[tuple[float, int, int, tuple[int, ...], int, float]] = field(default_factory=list)
    order: itertools.count = field(default_factory=itertools.count)
    # State.key -> node: a state reached again (the same commits in another order) is not
    # drafted twice; the walk finds it wherever it is (`spot.tree.verify_walk`)
    index: dict[tuple, int] = field(default_factory=dict)
    rows: dict[int, object] = field(default_factory=dict)  # read model row per evaluated node
    source: dict[int, int] = field(default_factory=dict)  # node -> evaluated node whose row it uses
    drawn: dict[int, tuple[list[int], list[float]]] = field(default_factory=dict)
    alternatives: dict[tuple[int, int], tuple[list[int], list[float]]] = field(default_factory=dict)

    def draw(self, step: int) -> tuple[list[int], list[float]]:
        """The drafted tokens and their log-confidences at `step`, as lists (read per node).

        At T=0 they are read off the stale top-k, which holds the argmax and its
        log-probability already (no second pass over [B, V], docs/benchmarks.md §6.1)."""
        step = self.noise.noise_step(step)
        if step not in self.drawn:
            if self.inp.config.temperature == 0.0:
                # the mask token is never drawn: where it is the top, the runner-up is
                second = self.top_ids[:, 0] == self.inp.layout.mask_id
                tokens = torch.where(second, self.top_ids[:, 1], self.top_ids[:, 0])
                log_conf = torch.where(second, self.top_logprobs[:, 1], self.top_logprobs[:, 0])
            else:
                tokens, conf = self.noise.draw(self.inp, step)
                log_conf = conf.double().clamp_min(1e-30).log()
            self.drawn[step] = (tokens.tolist(), log_conf.tolist())
        return self.drawn[step]

    def ranked(self, step: int, choice: int) -> tuple[list[int], list[float]]:
        """The `choice`-th most likely tokens per position at `step` and their stale
        log-probabilities (0: the drawn ones, `draw`); among the stale top-k, never the mask
        token nor the drawn one. At T=0 ranked by the stale distribution, at T>0 by the
        step's coupled noise over it (the target's next picks if its distribution moved a
        little), with probabilities over the top-k."""
        if choice == 0:
            return self.draw(step)
        noise_step = self.noise.noise_step(step)
        if (noise_step, choice) not in self.alternatives:
            drawn = torch.tensor(self.draw(step)[0])
            logp = self.top_logprobs.double()
            scores = logp.clone()
            temperature = self.inp.config.temperature
            if temperature > 0.0:
                g = self.noise.gumbel(self.inp.key, step, self.inp.stale_logits)
                logp = torch.log_softmax(logp / temperature, dim=-1)
                scores = logp + g.gather(-1, self.top_ids.long().to(g.device)).cpu()
            excluded = (self.top_ids == drawn[:, None]) | (self.top_ids == self.inp.layout.mask_id)
            scores = scores.masked_fill(excluded, float("-inf"))
            pick = scores.argsort(dim=-1, descending=True, stable=True)[:, choice - 1 : choice]
            tokens = self.top_ids.gather(-1, pick).squeeze(-1)
            log_conf = logp.gather(-1, pick).squeeze(-1)
            log_conf = log_conf.masked_fill(scores.gather(-1, pick).squeeze(-1).isinf(), -math.inf)
            self.alternatives[noise_step, choice] = (tokens.tolist(), log_conf.tolist())
        return self.alternatives[noise_step, choice]


class BestFirstDrafter(BudgetedDrafter):
    """Grows one tree per request, best candidate first; subclasses say which moves (sets of
    positions to commit next, with log-probabilities) a node admits."""

    rules: tuple[str, ...] = ()

    def __init__(
        self, budget: int, per_round: int = 4, branching: int = 4, refresh: int | None = 1
    ):
        """refresh: evaluate the model on a node only every `refresh` levels below the last
        evaluated one; nodes in between reuse that evaluation (over their remaining masked
        positions), which trades drafting accuracy for fewer model calls per tree. None: the
        root's evaluation serves the whole tree (one model call per proposal)."""
        self.budget = budget
        self.per_round = per_round
        self.branching = branching
        self.refresh = refresh

    def _evaluate(self, frontier: list[tuple[_Growing, int]]) -> torch.Tensor:
        """The model's output rows [len(frontier), B] for the frontier's nodes, one batch."""
        raise NotImplementedError

    def _moves_from(self, g: _Growing, n: int, row) -> list[tuple]:
        """Moves (log-probability, positions committed next[, token choice]) of node n from a
        model row (as `_read_row` returns it). A token choice j > 0 drafts the positions' j-th
        most likely tokens instead of the drawn ones (`_Growing.ranked`); its
        log-probability then carries the log-ratio of their stale probabilities to the drawn
        tokens'."""
        raise NotImplementedError

    def _read_row(self, row: torch.Tensor):
        """A model row [B] in the form `_moves_from` reads; read once per evaluated node."""
        return row

    def _push(self, g: _Growing, n: int, row: torch.Tensor) -> None:
        for logp, positions, *choice in self._moves_from(g, n, row):
            j = choice[0] if choice else 0
            base = g.score[n] + logp
            if j:  # ranked as its tokens' probabilities say, scored like the drawn move
                _, drawn = g.draw(g.nodes[n].step)
                _, alternative = g.ranked(g.nodes[n].step, j)
                base -= sum(alternative[p] - drawn[p] for p in positions)
            priority = g.score[n] + logp
            heapq.heappush(g.heap, (-priority, next(g.order), n, positions, j, base))

    @torch.inference_mode()  # not no_grad: less dispatch overhead per proposal
    def draft(self, inputs: Sequence[DraftInput], noise: StepNoise, budget: int) -> list[DraftTree]:
        growing: list[_Growing | None] = [self._start(inp, noise, budget) for inp in inputs]
        frontier = [(g, 0) for g in growing if g is not None]
        while frontier:
            for (g, n), row in zip(frontier, self._evaluate(frontier)):
                row = g.rows[n] = self._read_row(row)
                g.source[n] = n
                self._push(g, n, row)
            frontier = []
            for g in growing:
                if g is None:
                    continue
                fresh = 0  # nodes of this round that need the model
                while fresh < self.per_round and len(g.nodes) - 1 < budget and g.heap:
                    node = self._expand(g)
                    if node is None or not self._in_stale_block(g, g.nodes[node]):
                        continue
                    evaluated = g.source[g.parent[node]]
                    if (
                        self.refresh is None
                        or g.nodes[node].step - g.nodes[evaluated].step < self.refresh
                    ):
                        g.source[node] = evaluated
                        self._push(g, node, g.rows[evaluated])
                    else:
                        frontier.append((g, node))
                        fresh += 1
        return [
            DraftTree.single(inp.root) if g is None else DraftTree(tuple(g.nodes), tuple(g.parent))
            for inp, g in zip(inputs, growing)
        ]

    @staticmethod
    def _in_stale_block(g: _Growing, node: State) -> bool:
        """Only states of the stale forward's block can be drafted further from it."""
        b = g.inp.layout.block_length
        return not node.done and node.block_start(b) == g.inp.stale_state.block_start(b)

    def _start(self, inp: DraftInput, noise: StepNoise, budget: int) -> _Growing | None:
        b = inp.layout.block_length
        if budget == 0 or inp.root.done:
            return None
        if inp.root.block_start(b) != inp.stale_state.block_start(b):
            return None  # the stale logits belong to the previous block
        if inp.config.rule not in self.rules:
            raise ValueError(
                f"{type(self).__name__} drafts for the {'/'.join(self.rules)} rule, "
                f"not {inp.config.rule!r}"
            )
        # reduced where the logits are; the tree is built on the CPU
        top_logprobs, top_ids = (t.cpu() for t in stale_top(inp.stale_logits, self.top_k))
        stale_masked = inp.stale_state.block(b) == inp.layout.mask_id
        root_masked = (inp.root.block(b) == inp.layout.mask_id).tolist()
        return _Growing(
            inp,
            noise,
            top_logprobs,
            top_ids,
            stale_masked,
            [inp.root],
            [-1],
            [0.0],
            [root_masked],
            index={inp.root.key: 0},
        )

    def _node_features(self, g: _Growing, n: int, config) -> tuple[torch.Tensor, torch.Tensor]:
        """Order features [1, B, F] of node n and its mask [1, B]."""
        inp, node = g.inp, g.nodes[n]
        masked = node.block(inp.layout.block_length) == inp.layout.mask_id
        conf = noisy_confidence(
            g.top_logprobs,
            g.top_ids,
            g.noise.gumbel(inp.key, node.step, inp.stale_logits),
            inp.config.temperature,
            inp.confidence,
        )
        feats = order_features(
            g.top_logprobs[None],
            masked[None],
            (g.stale_masked & ~masked)[None],
            conf[None],
            torch.tensor([node.block_step / inp.layout.steps_per_block]),
            torch.tensor([node.step - inp.stale_state.step]),
            config,
        )
        return feats, masked[None]

    def _expand(self, g: _Growing) -> int | None:
        """Pop the best candidate and add its state as a node; returns the node index, or
        None when the tree holds that state already."""
        _, _, parent, positions, choice, base = heapq.heappop(g.heap)
        node = g.nodes[parent]
        tokens, log_conf = g.ranked(node.step, choice)
        block = node.block(g.inp.layout.block_length).clone()
        masked = g.masked[parent].copy()
        for p in positions:
            block[p] = tokens[p]
            masked[p] = False
        state = advance(g.inp.layout, node, block)
        if g.index.setdefault(state.key, len(g.nodes)) != len(g.nodes):
            return None
        g.nodes.append(state)
        g.parent.append(parent)
        g.score.append(base + sum(log_conf[p] for p in positions))
        g.masked.append(masked)
        return len(g.nodes) - 1


class SpotDrafter(BestFirstDrafter):
    """SPOT: the order model ranks the next committed position (static rule); with k tokens
    per step the other k-1 are the most confident remaining positions."""

    rules = SPOT_RULES

    def __init__(
        self,
        model: OrderModel,
        budget: int,
        per_round: int = 4,
        branching: int = 4,
        refresh: int | None = None,
        token_choices: int = 1,
    ):
        """refresh None: the root's scores, renormalised over each node's remaining masked
        positions, rank the whole tree: as good a tree as re-evaluating every few levels, for
        one model call per proposal (docs/benchmarks.md §6.1). token_choices: how many of
        each position's most likely tokens a node may draft (one commit per step only): off
        the prompts the target was trained on, the stale token is wrong more often, and a
        runner-up token is then a child of its own."""
        super().__init__(budget, per_round, branching, refresh)
        self.model = model.eval()
        self.top_k = model.config.top_k
        self.token_choices = token_choices

    def _evaluate(self, frontier):
        feats, masks = zip(*(self._node_features(g, n, self.model.config) for g, n in frontier))
        return self.model(torch.cat(feats), torch.cat(masks)).float()

    def _read_row(self, row):
        """(scores, positions with a finite score, best first): plain Python, since a tree
        ranks the same row's positions at every node it serves."""
        scores = row.double().tolist()
        return scores, sorted(
            (p for p, v in enumerate(scores) if v > -math.inf), key=lambda p: -scores[p]
        )

    def _moves_from(self, g, n, row):
        scores, ranked = row
        node, masked = g.nodes[n], g.masked[n]
        layout = g.inp.layout
        b = layout.block_length
        live = [p for p in ranked if masked[p]]
        if not live:
            return []
        top = scores[live[0]]
        log_z = top + math.log(sum(math.exp(scores[p] - top) for p in live))
        k = max(1, layout.commit_count(node.block_start(b), node.block_step))
        by_conf: list[int] = []
        if k > 1:
            _, conf = g.noise.draw(g.inp, node.step)
            mask = torch.tensor(masked)
            by_conf = confidence_order(conf[None], mask[None])[0, : len(live)].tolist()
        moves = []
        for pos in live[: self.branching]:
            rest = [p for p in by_conf if p != pos][: k - 1]
            moves.append((scores[pos] - log_z, (pos, *rest)))
            if k == 1 and self.token_choices > 1:
                _, drawn = g.draw(node.step)
                for j in range(1, self.token_choices):
                    _, alternative = g.ranked(node.step, j)
                    if alternative[pos] > -math.inf:
                        logp = scores[pos] - log_z + alternative[pos] - drawn[pos]
                        moves.append((logp, (pos,), j))
        return moves
