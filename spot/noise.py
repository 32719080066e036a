"""Coupled noise: Gumbel noise keyed by (seed, request, step), never by a global stream.

Every decoder draws the noise of step t of a request from the same key, so the target's
transition is a deterministic function of (state, logits, key) and a drafted state can be
checked by exact equality (docs/design.md §1.5). Keys do not depend on batch size, batch order,
replica or tensor-parallel rank. The generator is counter-based integer arithmetic in
tensor ops, so the noise is made where the logits are, with the same bits on any device.
"""

from __future__ import annotations

import hashlib

import torch

_MASK64 = (1 << 64) - 1
# recorded with trajectories: features of T>0 steps are recomputed from the same noise
GENERATOR = "splitmix64-stream"


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


def _int64(x: int) -> int:
    """The signed int64 with the bits of the unsigned 64-bit `x` (torch has no uint64 math)."""
    x &= _MASK64
    return x - (1 << 64) if x >> 63 else x


_GAMMA = _int64(0x9E3779B97F4A7C15)
_MIX1 = _int64(0xBF58476D1CE4E5B9)
_MIX2 = _int64(0x94D049BB133111EB)
# CPU rows are hashed in chunks of about this many elements, so that the ~12 in-place passes
# run in cache (docs/benchmarks.md §6.1)
_CPU_CHUNK = 1 << 17


def _xor_shift_right_(z: torch.Tensor, shift: int, scratch: torch.Tensor) -> None:
    """z ^= z >> shift, the shift logical (torch shifts int64 arithmetically)."""
    torch.bitwise_right_shift(z, shift, out=scratch)
    z.bitwise_xor_(scratch.bitwise_and_((1 << (64 - shift)) - 1))


def _uniform_(out: torch.Tensor, key: int, first: int) -> None:
    """Fill `out` [R, V] float64 with outputs first+1, first+2, ... of the SplitMix64 stream
    seeded with `key`, row-major, as uniforms in (0, 1) (the top 53 bits, offset by half)."""
    rows, vocab = out.shape
    z = torch.arange(first + 1, first + 1 + rows * vocab, device=out.device).view(rows, vocab)
    z.mul_(_GAMMA).add_(_int64(key))
    scratch = torch.empty_like(z)
    _xor_shift_right_(z, 30, scratch)
    z.mul_(_MIX1)
    _xor_shift_right_(z, 27, scratch)
    z.mul_(_MIX2)
    _xor_shift_right_(z, 31, scratch)
    torch.bitwise_right_shift(z, 11, out=scratch).bitwise_and_((1 << 53) - 1)
    out.copy_(scratch).add_(0.5).mul_(2.0**-53)


def gumbel(
    seed: int,
    request: int,
    step: int,
    shape: tuple[int, int],
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Standard Gumbel noise g[t] of `shape` (block_length, vocab), float64, made on `device`
    (default CPU) so that a GPU target neither waits for the CPU nor copies it over.

    Element (p, v) is -log(-log(u)) of output p * vocab + v + 1 of the SplitMix64 stream
    seeded with `step_key(seed, request, step)`: integer arithmetic, the same bits on every
    device."""
    rows, vocab = shape
    out = torch.empty(shape, dtype=torch.float64, device=device)
    chunk = rows if out.device.type != "cpu" else max(1, _CPU_CHUNK // max(vocab, 1))
    key = step_key(seed, request, step)
    for start in range(0, rows, chunk):
        _uniform_(out[start : start + chunk], key, start * vocab)
    return out.log_().neg_().log_().neg_()
