"""Coupled noise: Gumbel noise keyed by (seed, request, step), never by a global stream.

Every decoder draws the noise of step t of a request from the same key, so the target's
transition is a deterministic function of (state, logits, key) and a drafted state can be
checked by exact equality (DESIGN §1). Keys do not depend on batch size, batch order,
replica or tensor-parallel rank.
"""

from __future__ import annotations

import hashlib

import torch

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def request_key(request_id: str | int, sample_index: int = 0) -> int:
    """A stable 63-bit key for one sample of one request id (same on every machine)."""
    digest = hashlib.blake2b(f"{request_id!s}\x1f{sample_index}".encode(), digest_size=8)
    return int.from_bytes(digest.digest(), "little") >> 1


def step_key(seed: int, request: int, step: int) -> int:
    """Mix (job seed, request key, step) into one generator seed."""
    x = _splitmix64(seed & _MASK64)
    x = _splitmix64(x ^ (request & _MASK64))
    x = _splitmix64(x ^ (step & _MASK64))
    return x >> 1


def gumbel(seed: int, request: int, step: int, shape: tuple[int, ...]) -> torch.Tensor:
    """Standard Gumbel noise g[t] of `shape` (block_length, vocab), float64, on the CPU."""
    generator = torch.Generator(device="cpu").manual_seed(step_key(seed, request, step))
    u = torch.rand(shape, generator=generator, dtype=torch.float64)
    tiny = torch.finfo(torch.float64).tiny
    return -torch.log(-torch.log(u.clamp_(min=tiny)))
