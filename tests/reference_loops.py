"""Each family's reference decoding loop, re-written in its simplest form for the tests.

Batch 1 and a full forward of the sequence at every step, no KV cache (under block-causal
attention a fresh forward gives a finished block exactly the keys its cache would hold), but
otherwise in each reference's own terms: its block grid, its transfer schedule, its confidence,
its threshold comparison, its stop rule and the shape of what it returns. The model is anything
with `full_logits(ids [1, L], attention_mask [1, 1, L, L] bool or None) -> [1, L, V]`.

Written from the algorithms of: JetAstra/SDAR `generate.py` and its evaluation loop
(`block_diffusion_generate`), ML-GSAI/LLaDA `generate.py`, NVlabs/Fast-dLLM `llada/generate.py`
(threshold rule) and `dream/model/generation_utils_block.py`, and LLaDA2.0's `generate`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

NEG_INF = float("-inf")


class FullLogits(Protocol):
    def full_logits(
        self, ids: torch.Tensor, attention_mask: torch.Tensor | None
    ) -> torch.Tensor: ...


def get_num_transfer_tokens(count: int, steps: int) -> torch.Tensor:
    """[steps] tokens per step: `count` split evenly, the remainder going to the first steps."""
    schedule = torch.full((steps,), count // steps, dtype=torch.long)
    schedule[: count % steps] += 1
    return schedule


def block_causal_mask(num_blocks: int, block_length: int) -> torch.Tensor:
    """[1, 1, L, L] bool, True = attend: a block sees itself and every block before it."""
    blocks = torch.tril(torch.ones(num_blocks, num_blocks, dtype=torch.bool))
    full = blocks.repeat_interleave(block_length, 0).repeat_interleave(block_length, 1)
    return full[None, None]


def greedy(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """T=0 in every family: the argmax token and its untempered softmax probability.

    logits: [..., V]; returns tokens [...] and confidence [...]."""
    tokens = logits.argmax(dim=-1)
    probs = torch.softmax(logits, dim=-1)
    return tokens, probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def sdar_sample(
    logits: torch.Tensor,
    temperature: float,
    top_k: int,
    top_p: float,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """SDAR's `sample_with_temperature_topk_topp`: temperature, then top-k, then top-p, one
    multinomial draw, confidence = the draw's probability under that filtered distribution.

    SDAR's sampler divides by the temperature and so cannot run at T=0; the authors' greedy
    setting (temperature 1, top_k 1, confidence from the unfiltered softmax as in their
    evaluation loop) is `greedy`. logits: [B, V]."""
    if temperature == 0.0:
        return greedy(logits)
    if temperature != 1.0:
        logits = logits / temperature
    if top_k > 0:
        kth = torch.topk(logits, top_k).values[..., -1:]
        logits = torch.where(logits < kth, NEG_INF, logits)
    if top_p < 1.0:
        sorted_logits, sorted_index = torch.sort(logits, descending=True)
        drop = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1) > top_p
        drop[..., 1:] = drop[..., :-1].clone()
        drop[..., 0] = False
        logits = logits.masked_fill(drop.scatter(-1, sorted_index, drop), NEG_INF)
    probs = torch.softmax(logits, dim=-1)
    tokens = torch.multinomial(probs, 1, generator=generator)
    return tokens.squeeze(-1), probs.gather(-1, tokens).squeeze(-1)


def sdar_generate(
    model: FullLogits,
    prompt: torch.Tensor,
    *,
    mask_id: int,
    gen_length: int,
    block_length: int,
    denoising_steps: int,
    stop_ids: Sequence[int],
    threshold: float = 1.0,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """SDAR `block_diffusion_generate`; threshold < 1 is `low_confidence_dynamic`, else
    `low_confidence_static`. Returns x [num_blocks * block_length]: prompt, generated blocks,
    mask_id after the block where a stop id appeared."""
    p = prompt.numel()
    num_blocks = (p + gen_length + block_length - 1) // block_length
    mask = block_causal_mask(num_blocks, block_length)
    x = torch.full((1, num_blocks * block_length), mask_id, dtype=torch.long)
    x[0, :p] = prompt
    schedule = get_num_transfer_tokens(block_length, denoising_steps)
    # blocks before p // block_length are prefilled; the prompt's partial block is decoded
    for num_block in range(p // block_length, num_blocks):
        lo, hi = num_block * block_length, (num_block + 1) * block_length
        for step in range(denoising_steps + 1):
            cur = x[0, lo:hi]  # [B]
            mask_index = cur == mask_id
            if not mask_index.any():
                break  # here the reference writes the block's KV cache
            logits = model.full_logits(x[:, :hi], mask[..., :hi, :hi])[0, lo:hi]  # [B, V]
            x0, x0_p = sdar_sample(logits, temperature, top_k, top_p, generator)
            x0 = torch.where(mask_index, x0, cur)
            confidence = torch.where(mask_index, x0_p, NEG_INF)
            k = int(schedule[step])
            high = confidence > threshold
            transfer = torch.zeros_like(mask_index)
            if threshold < 1.0 and int(high.sum()) >= k:
                transfer = high
            else:
                transfer[torch.topk(confidence, k).indices] = True
            x[0, lo:hi] = torch.where(transfer, x0, cur)
        if torch.isin(x[0, p:], torch.tensor(list(stop_ids))).any():
            break
    return x[0]


def _llada_transfer(
    logits: torch.Tensor, x: torch.Tensor, block_end: int, mask_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """LLaDA's low-confidence step at T=0 over the whole sequence: x0 and confidence [L],
    -inf outside the masked positions up to the end of the current block."""
    mask_index = x == mask_id
    x0, x0_p = greedy(logits)
    x0_p[block_end:] = NEG_INF
    x0 = torch.where(mask_index, x0, x)
    return x0, torch.where(mask_index, x0_p, NEG_INF)


def llada_generate(
    model: FullLogits,
    prompt: torch.Tensor,
    *,
    mask_id: int,
    steps: int,
    gen_length: int,
    block_length: int,
) -> torch.Tensor:
    """ML-GSAI/LLaDA `generate` at T=0 (low_confidence, no CFG): blocks from the end of the
    prompt, steps // num_blocks steps per block, the block's mask count split evenly.
    Bidirectional, no stop: returns x [P + gen_length]."""
    p = prompt.numel()
    x = torch.full((p + gen_length,), mask_id, dtype=torch.long)
    x[:p] = prompt
    num_blocks = gen_length // block_length
    steps_per_block = steps // num_blocks
    for num_block in range(num_blocks):
        lo = p + num_block * block_length
        hi = lo + block_length
        schedule = get_num_transfer_tokens(int((x[lo:hi] == mask_id).sum()), steps_per_block)
        for step in range(steps_per_block):
            logits = model.full_logits(x[None], None)[0]  # [L, V]
            x0, confidence = _llada_transfer(logits, x, hi, mask_id)
            select = torch.topk(confidence, int(schedule[step])).indices
            x[select] = x0[select]
    return x


def fast_dllm_generate(
    model: FullLogits,
    prompt: torch.Tensor,
    *,
    mask_id: int,
    gen_length: int,
    block_length: int,
    threshold: float,
) -> torch.Tensor:
    """Fast-dLLM `llada/generate.py` `generate` (no cache) with a threshold: per step, the most
    confident masked position of the block and every other with confidence >= threshold,
    until the block is complete. Returns x [P + gen_length]."""
    p = prompt.numel()
    x = torch.full((p + gen_length,), mask_id, dtype=torch.long)
    x[:p] = prompt
    for num_block in range(gen_length // block_length):
        lo = p + num_block * block_length
        hi = lo + block_length
        while (x[lo:hi] == mask_id).any():
            logits = model.full_logits(x[None], None)[0].to(torch.float64)  # [L, V]
            x0, confidence = _llada_transfer(logits, x, hi, mask_id)
            num_masked = int(torch.isfinite(confidence).sum())
            values, select = torch.topk(confidence, num_masked)
            keep = torch.ones_like(select, dtype=torch.bool)
            keep[1:] = values[1:] >= threshold
            x[select[keep]] = x0[select[keep]]
    return x


def llada2_generate(
    model: FullLogits,
    prompt: torch.Tensor,
    *,
    mask_id: int,
    eos_id: int,
    gen_length: int,
    block_length: int,
    steps: int,
    threshold: float,
    minimal_topk: int = 1,
) -> torch.Tensor:
    """LLaDA2.0 `generate` at T=0: absolute block grid, the whole sequence up to the current
    block recomputed at each step under the block-causal mask, the block's schedule kept for
    the prompt's partial block, commit {confidence > threshold} when there are at least k of
    them else the top min(k, masked). Stops after the block holding an EOS; returns the
    generated tokens up to and including the first EOS (at most gen_length)."""
    steps = min(steps, gen_length // minimal_topk)
    p = prompt.numel()
    num_blocks = (p + gen_length + block_length - 1) // block_length
    mask = block_causal_mask(num_blocks, block_length)
    x = torch.full((1, num_blocks * block_length), mask_id, dtype=torch.long)
    x[0, :p] = prompt
    schedule = get_num_transfer_tokens(block_length, steps)
    for num_block in range(p // block_length, num_blocks):
        end = (num_block + 1) * block_length
        for step in range(steps):
            active = x[0, end - block_length : end] == mask_id  # [B]
            if not active.any():
                break
            logits = model.full_logits(x[:, :end], mask[..., :end, :end])[0, -block_length:]
            x0, x0_p = greedy(logits)
            k = int(schedule[step])
            confidence = torch.where(active, x0_p, NEG_INF)
            high = confidence > threshold
            if int(high.sum()) >= k:
                transfer = high
            else:
                transfer = torch.zeros_like(active)
                transfer[torch.topk(confidence, min(k, int(active.sum()))).indices] = True
            block = x[0, end - block_length : end]
            x[0, end - block_length : end] = torch.where(transfer, x0, block)
        if (x[0, p:end] == eos_id).any():
            break
    answer = x[0, p : p + gen_length]
    eos = (answer == eos_id).nonzero().flatten()
    return answer[: int(eos[0]) + 1] if eos.numel() else answer


def dream_block_generate(
    model: FullLogits,
    prompt: torch.Tensor,
    *,
    mask_id: int,
    gen_length: int,
    block_length: int,
    threshold: float,
    opening_commit: bool = True,
) -> torch.Tensor:
    """Fast-dLLM's block sampler for Dream (`generation_utils_block.py`, alg
    `confidence_threshold`) at T=0, a full forward of the whole canvas in place of its prefix
    cache. Blocks from the end of the prompt; the logits of position i are the model's output
    at i - 1. Each block opens with a forward whose prediction for the block's first position
    is committed outright (`opening_commit`); then, until the block is complete, the most
    confident masked position of the block and every other one with confidence >= threshold.
    No stop: returns x [P + gen_length]."""
    p = prompt.numel()
    x = torch.full((p + gen_length,), mask_id, dtype=torch.long)
    x[:p] = prompt

    def shifted_logits() -> torch.Tensor:
        logits = model.full_logits(x[None], None)[0]  # [L, V]
        return torch.cat([logits[:1], logits[:-1]])

    for lo in range(p, p + gen_length, block_length):
        hi = lo + block_length
        if opening_commit:
            x[lo] = shifted_logits()[lo].argmax()
        while (x[lo:hi] == mask_id).any():
            masked = x[lo:hi] == mask_id  # [B]
            x0, x0_p = greedy(shifted_logits()[lo:hi])
            confidence = torch.where(masked, x0_p, NEG_INF)
            values, select = torch.topk(confidence, int(masked.sum()))
            keep = torch.ones_like(select, dtype=torch.bool)
            keep[1:] = values[1:] >= threshold
            x[lo + select[keep]] = x0[select[keep]]
    return x
