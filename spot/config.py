"""Decoding configuration of the target's own transition (docs/design.md §1.3).

Plain frozen dataclasses: `spot/` knows only torch and the standard library. The pipeline's
pydantic job schema converts into these.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Literal

ConfidenceName = Literal["tempered", "untempered"]


class CommitRule(StrEnum):
    """Which masked positions a step commits (see `DecodingConfig`). Members are the strings
    job files use ("static", ...) and compare equal to them."""

    STATIC = "static"
    THRESHOLD = "threshold"
    SDAR_DYNAMIC = "sdar_dynamic"

    def __repr__(self) -> str:
        return repr(self.value)  # messages quote the rule as job files spell it


@dataclass(frozen=True)
class DecodingConfig:
    """How the target decodes; every decoder (draft-free or speculative) shares it.

    rule:
      static        commit the k most confident masked positions, k from the block schedule
      threshold     Fast-dLLM: commit every masked position with confidence >= threshold,
                    and always the most confident one
      sdar_dynamic  SDAR's variant: commit the positions with confidence > threshold when
                    there are at least k of them, else the k most confident
    confidence: which probability ranks positions at T>0 (at T=0 both are the untempered
      softmax probability of the argmax). None takes the target family's own definition.
    """

    gen_length: int = 256
    block_length: int = 32
    rule: CommitRule = CommitRule.STATIC
    tokens_per_step: int = 1
    threshold: float = 0.9
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    confidence: ConfidenceName | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.rule not in tuple(CommitRule):
            rules = ", ".join(CommitRule)
            raise ValueError(f"unknown commit rule {self.rule!r} (one of {rules})")
        object.__setattr__(self, "rule", CommitRule(self.rule))  # a name given as a string
        if self.block_length <= 0 or self.gen_length <= 0:
            raise ValueError("gen_length and block_length must be positive")
        if self.gen_length % self.block_length:
            raise ValueError(
                f"gen_length ({self.gen_length}) must be a multiple of "
                f"block_length ({self.block_length})"
            )
        if self.tokens_per_step <= 0 or self.block_length % self.tokens_per_step:
            raise ValueError(
                f"tokens_per_step ({self.tokens_per_step}) must divide "
                f"block_length ({self.block_length})"
            )
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if self.top_k is not None and self.top_k <= 0:
            raise ValueError("top_k must be positive")
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            raise ValueError("top_p must be in (0, 1]")
        if not 0.0 <= self.threshold <= 1.0:
            raise ValueError("threshold must be in [0, 1]")

    @property
    def steps_per_block(self) -> int:
        return self.block_length // self.tokens_per_step
