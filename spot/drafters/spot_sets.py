"""SPOT-Sets: speculative decoding for threshold decoding, where a step commits a *set*.

The set model reads the order features plus the target's last hidden states and the input
embeddings of the tokens the coupled noise would draw, both projected to the model width (so
targets of different widths share the rest of the network), and predicts for every masked
position the probability that it is in the next commit set. The tree's children of a node are
the most likely sets under independent inclusion (the thresholded set, then its cheapest
flips), grown best-first like SPOT.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from spot.drafters.order_model import DOUBT_SCALE, Encoder, Linear, OrderModelConfig
from spot.drafters.rules import SPOT_SETS_RULES
from spot.drafters.spot import BestFirstDrafter


@dataclass(frozen=True)
class SetModelConfig(OrderModelConfig):
    target_hidden_size: int = 128
    max_flips: int = 8  # uncertain positions considered when listing alternative sets


class SetModel(nn.Module):
    """(features [N,B,F], hidden [N,B,H], token embeddings [N,B,H], masked [N,B], threshold)
    -> inclusion logits [N, B] (-inf where not masked).

    Like the order model, a learned correction on top of the rule's own guess: the stale
    confidence's log-odds against the threshold's (a position passes the threshold if its
    distribution does not move), plus a learned bonus for the most confident masked position
    (the rule commits it even when nothing passes, which is most steps below the first: the
    stale forward's own passing positions are committed already). The correction head starts
    at zero."""

    def __init__(self, config: SetModelConfig):
        super().__init__()
        self.config = config
        d = config.d_model
        self.input = Linear(config.num_features, d)
        self.hidden_proj = Linear(config.target_hidden_size, d)
        self.token_proj = Linear(config.target_hidden_size, d)
        self.position = nn.Embedding(config.max_block_length, d)
        self.encoder = Encoder(config)
        self.norm = nn.LayerNorm(d)
        self.head = Linear(d, 1)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)
        self.prior_scale = nn.Parameter(torch.tensor(1.0))
        self.first_bonus = nn.Parameter(torch.tensor(4.0))

    def forward(self, features, hidden, token_embeddings, masked, threshold: float):
        b = features.shape[1]
        h = (
            self.input(features)
            + self.hidden_proj(hidden.float())
            + self.token_proj(token_embeddings.float())
            + self.position.weight[:b]
        )
        logits = self.head(self.norm(self.encoder(h))).squeeze(-1)
        c = self.config
        conf = features[..., c.confidence_index].clamp(1e-7, 1.0)
        doubt = features[..., c.log_doubt_index] * DOUBT_SCALE  # log(1 - conf)
        bar = min(max(threshold, 1e-6), 1.0 - 1e-6)  # a threshold of 1 passes nothing
        log_odds = conf.log() - doubt - math.log(bar / (1.0 - bar))
        first = (features[..., c.rank_index] == 0) & masked
        logits = logits + self.prior_scale * log_odds + self.first_bonus * first
        return logits.masked_fill(~masked, float("-inf"))


def likely_sets(
    logits: torch.Tensor, masked: torch.Tensor, count: int, max_flips: int
) -> list[tuple[float, tuple[int, ...]]]:
    """The `count` most likely non-empty commit sets under independent inclusion.

    logits: [B] inclusion logits; masked: [B] bool. Start from the thresholded set (q >= 0.5)
    and enumerate flips of the `max_flips` most uncertain positions in order of cost.
    Returns (log-probability, sorted positions) pairs, most likely first.
    """
    positions = masked.nonzero().flatten().tolist()
    if not positions:
        return []
    lg = logits.double()
    log_in = torch.nn.functional.logsigmoid(lg)
    log_out = torch.nn.functional.logsigmoid(-lg)
    base = {p for p in positions if lg[p] >= 0}
    base_logp = sum(float(log_in[p] if p in base else log_out[p]) for p in positions)
    uncertain = sorted(positions, key=lambda p: abs(float(lg[p])))[:max_flips]
    cost = [abs(float(lg[p])) for p in uncertain]
    out: list[tuple[float, tuple[int, ...]]] = []
    heap: list[tuple[float, tuple[int, ...]]] = [(0.0, ())]
    while heap and len(out) < count:
        c, flips = heapq.heappop(heap)
        chosen = base.symmetric_difference(uncertain[i] for i in flips)
        if chosen:
            out.append((base_logp - c, tuple(sorted(chosen))))
        last = flips[-1] if flips else -1
        if last + 1 < len(uncertain):
            heapq.heappush(heap, (c + cost[last + 1], (*flips, last + 1)))
            if flips:
                swapped = (*flips[:-1], last + 1)
                heapq.heappush(heap, (c - cost[last] + cost[last + 1], swapped))
    return out


class SpotSetsDrafter(BestFirstDrafter):
    """SPOT-Sets for the threshold rules: children are likely next commit sets."""

    rules = SPOT_SETS_RULES
    needs_hidden = True

    def __init__(
        self,
        model: SetModel,
        embed: Callable[[torch.Tensor], torch.Tensor],
        budget: int,
        per_round: int = 4,
        branching: int = 4,
        refresh: int | None = None,
    ):
        """refresh None: the root's inclusion logits serve the whole tree. Threshold trees are
        shallow (most walks stop at the first level), so evaluating every node buys little
        for twice the model calls; deeper trees lose some at large budgets and gain at the
        small ones `auto` picks (docs/benchmarks.md §6.1)."""
        super().__init__(budget, per_round, branching, refresh)
        self.model = model.eval()
        self.embed = embed
        self.top_k = model.config.top_k

    def _evaluate(self, frontier):
        feats, masks, hidden, token_emb = [], [], [], []
        for g, n in frontier:
            f, m = self._node_features(g, n, self.model.config)
            feats.append(f)
            masks.append(m)
            hidden.append(g.inp.stale_hidden.cpu()[None].float())  # the model is on the CPU
            tokens, _ = g.noise.draw(g.inp, g.nodes[n].step)
            token_emb.append(self.embed(tokens).cpu()[None].float())
        threshold = frontier[0][0].inp.config.threshold
        return self.model(
            torch.cat(feats), torch.cat(hidden), torch.cat(token_emb), torch.cat(masks), threshold
        )

    def _moves_from(self, g, n, row):
        return likely_sets(
            row, torch.tensor(g.masked[n]), self.branching, self.model.config.max_flips
        )


def set_log_likelihood(logits: torch.Tensor, label: torch.Tensor, masked: torch.Tensor):
    """Mean Bernoulli log-likelihood over masked positions, per sample [N]."""
    lg = logits.masked_fill(~masked, 0.0)
    ll = torch.where(label, torch.nn.functional.logsigmoid(lg), torch.nn.functional.logsigmoid(-lg))
    return (ll * masked).sum(-1) / masked.sum(-1).clamp_min(1)


def exact_set_accuracy(logits: torch.Tensor, label: torch.Tensor, masked: torch.Tensor) -> float:
    """Fraction of samples whose most likely set is exactly the committed set."""
    predicted = (logits >= 0) & masked
    empty = ~predicted.any(-1)
    best = logits.masked_fill(~masked, -math.inf).argmax(-1)
    predicted[empty, best[empty]] = True
    return float((predicted == (label & masked)).all(-1).float().mean())
