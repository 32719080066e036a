"""A toy target: a deterministic function of the whole sequence, bidirectional, no cache.

Small vocabulary, float64, seeded weights: enough structure (context dependence, a real
EOS, confident and unconfident positions) to exercise the decode loop and the walk.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spot.target import Scores, Window


@dataclass
class ToyContext:
    tokens: torch.Tensor  # [total] committed tokens, mask elsewhere
    committed: int = 0


class ToyTarget:
    vocab_size = 12
    hidden_size = 8
    mask_id = 11
    eos_ids = (10,)
    confidence = "untempered"
    max_length = 512
    opening_commit = False
    block_causal = False
    prefix_cache_problem = "the toy target attends bidirectionally"

    def __init__(self, seed: int = 0, absolute_block_grid: bool = False, sharpness: float = 3.0):
        g = torch.Generator().manual_seed(seed)
        d = self.hidden_size
        self.absolute_block_grid = absolute_block_grid
        self.embed_table = torch.randn(self.vocab_size, d, generator=g, dtype=torch.float64)
        self.pos = torch.randn(self.max_length, d, generator=g, dtype=torch.float64) * 0.5
        self.mix = torch.randn(d, d, generator=g, dtype=torch.float64) / d**0.5
        self.out = torch.randn(d, self.vocab_size - 1, generator=g, dtype=torch.float64)
        self.sharpness = sharpness
        self.forwards = 0

    def open(self, prompt: torch.Tensor, total_length: int) -> ToyContext:
        tokens = torch.full((total_length,), self.mask_id, dtype=torch.long)
        tokens[: prompt.numel()] = prompt
        return ToyContext(tokens)

    def committed_length(self, context: ToyContext) -> int:
        return context.committed

    def _logits(self, seq: torch.Tensor) -> torch.Tensor:
        h = self.embed_table[seq] + self.pos[: seq.numel()]
        ctx = torch.tanh(h.mean(0) @ self.mix)
        left = torch.cat([torch.zeros_like(h[:1]), h[:-1]])
        logits = self.sharpness * torch.tanh(h + ctx + 0.5 * left) @ self.out
        logits[:, self.eos_ids[0]] -= self.sharpness  # EOS now and then, not everywhere
        # the mask token is never predicted
        return torch.cat([logits, torch.full((seq.numel(), 1), -1e9, dtype=logits.dtype)], -1)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embed_table[tokens]

    def score(self, contexts, windows: list[Window], block_length: int, output_hidden=False):
        self.forwards += 1
        rows, hidden = [], []
        for w in windows:
            ctx = contexts[w.context]
            seq = ctx.tokens.clone()
            start = ctx.committed
            seq[start : start + w.tokens.numel()] = w.tokens
            end = start + w.tokens.numel()
            rows.append(self._logits(seq)[end - block_length : end])
            hidden.append(self.embed_table[seq[end - block_length : end]])
        for w in windows:
            if w.keep:
                ctx = contexts[w.context]
                ctx.tokens[ctx.committed : ctx.committed + w.keep] = w.tokens[: w.keep]
                ctx.committed += w.keep
        return Scores(torch.stack(rows), torch.stack(hidden) if output_hidden else None)
