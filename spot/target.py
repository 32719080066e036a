"""The one interface the decode loop uses to talk to a diffusion LM target.

A target knows nothing of trees or drafters: it opens a context per request (the prompt and,
for block-causal targets, the exact KV cache of committed blocks) and scores candidate states.
A candidate is a *window* of tokens starting at the context's committed length and ending at
the end of the candidate's current block: committed-but-not-yet-cached blocks, then the block
being decoded. One `score` call takes the windows of many requests, many per request.
A block-causal target may take a prefix cache (`spot.models.prefix_cache`) when it opens
contexts: a context then starts with its prompt's cached whole blocks already final.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from spot.config import ConfidenceName


@dataclass(frozen=True)
class Window:
    """One candidate state to score.

    context: index into the contexts passed to `score`.
    tokens: [W] tokens of positions [committed, committed + W); the last block_length of them
      are the block being decoded, W is a multiple of block_length.
    keep: how many leading tokens are final; the target makes them part of the context
      (writes their KV to the cache) from this very forward. At most one window per context
      may keep tokens, and only whole blocks.
    """

    context: int
    tokens: torch.Tensor
    keep: int = 0


@dataclass(frozen=True)
class Scores:
    logits: torch.Tensor  # [N, B, V] logits of each window's current block
    hidden: torch.Tensor | None  # [N, B, H] last hidden states, when asked for


class PrefixStore(Protocol):
    """A prefix cache as the decode loop sees it: made by the caller for one block length
    and handed to the target's `open` (`spot.models.prefix_cache.PrefixCache` is one)."""

    block_length: int


class Target(Protocol):
    """A diffusion LM as the decode loop sees it."""

    mask_id: int
    eos_ids: tuple[int, ...]
    vocab_size: int
    hidden_size: int
    absolute_block_grid: bool  # SDAR/LLaDA2: blocks aligned to position 0, else to the prompt end
    confidence: ConfidenceName  # the family's own confidence at T>0
    max_length: int  # longest sequence (prompt + generation) the target accepts
    opening_commit: bool  # each block's first transition commits its first position (Dream)
    block_causal: bool  # KV cache of final positions: a prompt is computed once, then reused
    prefix_cache_problem: str | None  # why it cannot take a prefix cache; None: it can

    def open(
        self, prompt: torch.Tensor, total_length: int, prefix_cache: PrefixStore | None = None
    ) -> Any:
        """A fresh context for one request: prompt [P] long, total sequence length; with a
        prefix cache (only where `prefix_cache_problem` is None), its prompt's longest cached
        whole-block prefix is final from the start."""
        ...

    def prefill_shared(self, contexts: Sequence[Any]) -> list[int]:
        """Make final, computing each once, the prompt prefixes that several of these freshly
        opened contexts (opened with a prefix cache) share and did not find cached; returns
        the positions computed in each context's name."""
        ...

    def committed_length(self, context: Any) -> int:
        """Positions [0, n) are final in this context; windows start at n."""
        ...

    def score(
        self,
        contexts: Sequence[Any],
        windows: Sequence[Window],
        block_length: int,
        output_hidden: bool = False,
    ) -> Scores:
        """Score every window in one forward (or one batched forward per shard)."""
        ...

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Input embeddings [..., H] of token ids [...]."""
        ...
