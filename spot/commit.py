"""The target's transition as pure functions: tokens, confidences, and which positions commit.

`next_block = commit_rule(block, logits, gumbel, k, config)` is the one definition every
decoder uses. Everything is computed in float64 so that the same inputs give the same
decision on every batch layout; ties are broken by the lower position index.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from spot.config import CommitRule, ConfidenceName, DecodingConfig


def transfer_schedule(num_masked: int, steps: int) -> list[int]:
    """Tokens to commit at each step of a block (LLaDA's `get_num_transfer_tokens`):
    `num_masked` split as evenly as possible over `steps`, the remainder going first."""
    base, remainder = divmod(num_masked, steps)
    return [base + (1 if i < remainder else 0) for i in range(steps)]


def filter_logits(logits: torch.Tensor, top_k: int | None, top_p: float | None) -> torch.Tensor:
    """Set logits outside the top-k / nucleus top-p set to -inf (the last dim is the vocab)."""
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, sorted_index = torch.sort(logits, dim=-1, descending=True, stable=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        remove_sorted = probs.cumsum(dim=-1) - probs > top_p
        remove = remove_sorted.scatter(-1, sorted_index, remove_sorted)
        logits = logits.masked_fill(remove, float("-inf"))
    return logits


@dataclass(frozen=True)
class SamplingScores:
    """What sampling from one set of logits needs before the noise: a drafter draws many
    steps from the same stale logits, each with its own noise, and prepares them once."""

    scores: torch.Tensor  # [..., V] float64: tempered, filtered logits (T=0: the logits), mask -inf
    probs: torch.Tensor  # [..., V] float64: the distribution confidences are read from


def sampling_scores(
    logits: torch.Tensor,
    temperature: float,
    top_k: int | None = None,
    top_p: float | None = None,
    confidence: ConfidenceName = "tempered",
    mask_id: int | None = None,
) -> SamplingScores:
    """The noise-free part of `sample_tokens` (same arguments)."""
    logits = logits.to(torch.float64)
    if temperature == 0.0:
        return SamplingScores(_never_mask(logits, mask_id), torch.softmax(logits, dim=-1))
    tempered = filter_logits(logits / temperature, top_k, top_p)
    reference = tempered if confidence == "tempered" else logits
    return SamplingScores(_never_mask(tempered, mask_id), torch.softmax(reference, dim=-1))


def pick_tokens(
    prepared: SamplingScores, gumbel: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens [...] and confidences [...] under the noise `gumbel` [..., V] (None at T=0)."""
    scores = prepared.scores
    if gumbel is not None:
        scores = scores + gumbel.to(scores.device)
    tokens = scores.argmax(dim=-1)
    return tokens, prepared.probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def sample_tokens(
    logits: torch.Tensor,
    gumbel: torch.Tensor | None,
    temperature: float,
    top_k: int | None = None,
    top_p: float | None = None,
    confidence: ConfidenceName = "tempered",
    mask_id: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token and confidence per position.

    logits: [..., V] (any float dtype; computed in float64), gumbel: [..., V] or None at T=0.
    Returns tokens [...] (long) and confidence [...] (float64).
    T=0: argmax of the logits and its softmax probability. T>0: Gumbel-max over the tempered,
    filtered logits (an exact sample of softmax(filtered(logits / T))); confidence is that
    distribution's probability of the token ("tempered", SDAR/Dream) or the plain softmax
    probability ("untempered", LLaDA). The mask token, when given, is never chosen (so every
    commit makes progress); probabilities stay over the whole vocabulary.
    """
    if temperature > 0.0 and gumbel is None:
        raise ValueError("temperature > 0 needs Gumbel noise")
    prepared = sampling_scores(logits, temperature, top_k, top_p, confidence, mask_id)
    return pick_tokens(prepared, gumbel if temperature > 0.0 else None)


def _never_mask(scores: torch.Tensor, mask_id: int | None) -> torch.Tensor:
    if mask_id is None:
        return scores
    scores = scores.clone()
    scores[..., mask_id] = float("-inf")
    return scores


def confidence_order(confidence: torch.Tensor, masked: torch.Tensor) -> torch.Tensor:
    """Positions [N, B] by descending confidence, masked ones first, lower index first on ties:
    the order every commit rule takes positions in."""
    score = confidence.masked_fill(~masked, float("-inf"))
    return torch.sort(score, dim=-1, descending=True, stable=True).indices


def confidence_rank(confidence: torch.Tensor, masked: torch.Tensor) -> torch.Tensor:
    """Rank [N, B] of each position in `confidence_order` (unmasked positions rank last)."""
    order = confidence_order(confidence, masked)
    arange = torch.arange(order.shape[-1], device=order.device).expand_as(order)
    return torch.empty_like(order).scatter_(-1, order, arange)


def select_commits(
    confidence: torch.Tensor,
    masked: torch.Tensor,
    k: torch.Tensor,
    rule: CommitRule | str,
    threshold: float,
) -> torch.Tensor:
    """Which positions commit this step.

    confidence: [N, B] float64, masked: [N, B] bool, k: [N] long (static count for this step).
    Returns [N, B] bool, always a subset of `masked`, never empty where anything is masked.
    """
    select = _SELECT.get(rule)  # a CommitRule or its string
    if select is None:
        raise ValueError(f"unknown commit rule {rule!r}")
    score = confidence.masked_fill(~masked, float("-inf"))
    rank = confidence_rank(confidence, masked)
    top = masked & (rank < torch.minimum(k, masked.sum(dim=-1)).unsqueeze(-1))
    return select(masked, score, rank, top, threshold)


def _static(masked, score, rank, top, threshold):
    """The k most confident masked positions."""
    return top


def _threshold(masked, score, rank, top, threshold):
    """Every masked position at least `threshold` confident, and always the most confident."""
    return masked & ((rank == 0) | (score >= threshold))


def _sdar_dynamic(masked, score, rank, top, threshold):
    """The positions above `threshold` when there are at least k of them, else the top k."""
    high = masked & (score > threshold)
    use_high = high.sum(dim=-1) >= top.sum(dim=-1)
    return torch.where(use_high.unsqueeze(-1), high, top)


# one selection per rule: (masked, score, rank, top-k set [N, B], threshold) -> [N, B] bool
_SELECT = {
    CommitRule.STATIC: _static,
    CommitRule.THRESHOLD: _threshold,
    CommitRule.SDAR_DYNAMIC: _sdar_dynamic,
}


def commit_rule(
    block: torch.Tensor,
    logits: torch.Tensor,
    gumbel: Sequence[torch.Tensor] | None,
    k: torch.Tensor,
    config: DecodingConfig,
    mask_id: int,
    confidence: ConfidenceName,
    opening: torch.Tensor | None = None,
) -> torch.Tensor:
    """The target's next block state.

    block: [N, B] tokens with mask_id where still masked; logits: [N, B, V] the target's
    logits for that state (read at masked positions only); gumbel: the noise [B, V] of each
    row's step, N tensors or one [N, B, V] (None at T=0): rows at the same step pass the
    same tensor, and only their masked positions are gathered (a tree of 17 states over a
    151936-token vocabulary would stack 631 MiB); k: [N] static count of each row's step;
    opening: [N] bool, rows whose transition commits the first masked position whatever the
    rule (Dream's block opening).
    Returns the next block state [N, B].
    """
    masked = block == mask_id
    at = masked.to(logits.device)  # only masked positions can commit: sample those alone
    noise = None
    if gumbel is not None:
        noise = torch.cat([g.to(logits.device)[m] for g, m in zip(gumbel, at, strict=True)])
    picked, picked_conf = sample_tokens(
        logits[at],
        noise,
        config.temperature,
        config.top_k,
        config.top_p,
        confidence,
        mask_id,
    )
    tokens = torch.full(block.shape, mask_id, dtype=torch.long, device=logits.device)
    tokens[at] = picked
    conf = torch.zeros(block.shape, dtype=torch.float64, device=logits.device)
    conf[at] = picked_conf
    conf = conf.to(block.device)
    commit = select_commits(conf, masked, k.to(block.device), config.rule, config.threshold)
    if opening is not None and bool(opening.any()):
        first = masked & (masked.cumsum(dim=-1) == 1)
        commit = torch.where(opening.to(block.device)[:, None], first, commit)
    return torch.where(commit, tokens.to(block.device), block)
