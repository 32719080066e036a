"""Draft-free decoding gives what each family's own reference loop gives (docs/design.md §1.4).

Tiny random checkpoints in each family's original format, saved and reloaded, decoded by
`spot.decode.generate` (batched, with the exact KV cache where the family has one) and by the
family's reference loop as written out in `tests/reference_loops.py` (batch 1, full
recomputation, the reference's own schedule and mask convention), in float64 so that equal
inputs give equal decisions. Cases: prompts that do and do not fill whole blocks, block lengths
4 and 8, 1 and 2 tokens per step, each reference's threshold variant, and EOS-heavy checkpoints
that exercise the stop rule. At T>0 the draws differ by design (coupled Gumbel noise instead of
`torch.multinomial`): there both samplers' first commits are tested against the exact law.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from spot.config import DecodingConfig
from spot.decode import Request, Result, generate
from spot.models.loading import load_model, load_target, save_checkpoint
from spot.models.registry import family_for
from spot.models.target import DiffusionTarget
from spot.tree import State
from tests import reference_loops as ref
from tests.reference_files import reference_checkpoint
from tests.test_models_dream_llada2 import random_model as dream_or_llada2_model
from tests.tiny_checkpoints import EOS_IDS, MASK_ID, random_model

PROMPT_LENGTHS = (1, 4, 6, 8, 11)  # whole blocks of 4 and 8, and partial ones
GRID = list(itertools.product((4, 8), (1, 2)))  # (block_length, tokens_per_step)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny matrices: one thread is many times faster on a shared machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _tiny_model(family: str, seed: int):
    if family in ("dream", "llada2"):
        return dream_or_llada2_model(family, seed=seed)
    return random_model(family, seed=seed)


def _save(directory: Path, family: str, model) -> DiffusionTarget:
    eos_ids = EOS_IDS[:1] if family == "llada2" else EOS_IDS  # LLaDA2.0 stops at one id
    return load_target(save_checkpoint(directory, family_for(family), model, MASK_ID, eos_ids))


@pytest.fixture(scope="module")
def targets(tmp_path_factory) -> dict[tuple[str, bool], DiffusionTarget]:
    """(family, EOS-heavy) -> target loaded from its original-format checkpoint. The EOS-heavy
    checkpoint gives EOS, scaled up a little, the output row of the token the plain one writes
    most often in the first block of the test prompts' answers: EOS then wins where that token
    would have, and most requests stop early."""
    root = tmp_path_factory.mktemp("faithful")
    prompts = _prompts()
    loaded = {}
    for family in ("sdar", "llada", "dream", "llada2"):
        model = _tiny_model(family, seed=7)
        plain = loaded[family, False] = _save(root / f"{family}-plain", family, model)
        first_blocks = [
            result.tokens[:b]
            for b in (4, 8)
            for result in _decode(plain, prompts, DecodingConfig(gen_length=2 * b, block_length=b))
        ]
        favourite = torch.cat(first_blocks).mode().values
        with torch.no_grad():
            model.lm_head.weight[EOS_IDS[0]] = 1.05 * model.lm_head.weight[favourite]
        loaded[family, True] = _save(root / f"{family}-eos-heavy", family, model)
    return loaded


def _prompts() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 290, (n,), generator=g) for n in PROMPT_LENGTHS]


def _decode(target, prompts, config: DecodingConfig) -> list[Result]:
    return generate(target, [Request(p, key=i) for i, p in enumerate(prompts)], config)


def _confidence_quantile(target, prompts, config: DecodingConfig, q: float) -> float:
    """A quantile of the top probabilities at the masked positions of the states that static
    decoding goes through: a threshold that some positions pass and others do not, whatever
    the tiny weights are."""
    seen = []

    def collect(index: int, state: State, logits: torch.Tensor, successor: State, hidden) -> None:
        masked = state.block(config.block_length) == target.mask_id
        seen.append(logits.softmax(-1).max(-1).values[masked])

    generate(target, [Request(p, key=i) for i, p in enumerate(prompts)], config, trace=collect)
    return float(torch.quantile(torch.cat(seen), q))


def _assert_stopped_after(result: Result, decoded: int, eos_ids) -> None:
    """The reference decoded `decoded` generated positions; past them the result is the EOS
    fill of a request that stopped at an EOS, or nothing."""
    tail = result.tokens[decoded:]
    has_eos = bool(torch.isin(result.tokens[:decoded], torch.tensor(eos_ids)).any())
    assert result.finish_reason == ("eos" if has_eos else "length")
    assert bool((tail == eos_ids[0]).all())
    assert has_eos or not tail.numel()


def _end_of_eos_block(generated: torch.Tensor, block_length: int, eos_ids) -> int:
    """Generated positions up to the end of the block holding the first EOS (blocks aligned
    to the first generated position), all of them without an EOS."""
    hits = torch.isin(generated, torch.tensor(eos_ids)).nonzero().flatten()
    if not hits.numel():
        return generated.numel()
    return -(-(int(hits[0]) + 1) // block_length) * block_length


def _exercised(results, decoded, config: DecodingConfig, heavy: bool) -> None:
    """The case tests what it claims: an EOS-heavy checkpoint stops requests early, and a
    threshold rule commits more than tokens_per_step positions at some step."""
    if heavy:
        assert any(r.tokens.numel() > n for r, n in zip(results, decoded))
    if config.rule != "static":
        assert any(r.stats.steps * config.tokens_per_step < n for r, n in zip(results, decoded))


def _block_rule(target, prompts, block_length: int, tokens_per_step: int, rule: str):
    """The decoding config of a block-diffusion case and the reference's threshold: 1.0 for
    the static rule, else the 0.7 quantile of the target's confidences (`sdar_dynamic`)."""
    config = DecodingConfig(
        gen_length=2 * block_length, block_length=block_length, tokens_per_step=tokens_per_step
    )
    if rule == "static":
        return config, 1.0
    threshold = _confidence_quantile(target, prompts, config, 0.7)
    return replace(config, rule=rule, threshold=threshold), threshold


# -- SDAR ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(("block_length", "tokens_per_step"), GRID)
@pytest.mark.parametrize("rule", ["static", "sdar_dynamic"])
@pytest.mark.parametrize("heavy", [False, True])
def test_sdar_matches_block_diffusion_generate(targets, block_length, tokens_per_step, rule, heavy):
    target = targets["sdar", heavy]
    prompts = _prompts()
    # SDAR's evaluation loop: a threshold of 1 is the static rule
    config, threshold = _block_rule(target, prompts, block_length, tokens_per_step, rule)
    results = _decode(target, prompts, config)
    decoded = []
    for prompt, result in zip(prompts, results):
        x = ref.sdar_generate(
            target.model,
            prompt,
            mask_id=MASK_ID,
            gen_length=config.gen_length,
            block_length=block_length,
            denoising_steps=config.steps_per_block,
            stop_ids=target.eos_ids,
            threshold=threshold,
        )
        p = prompt.numel()
        n = int((x[p:] != MASK_ID).sum())  # the reference leaves masks after its stop
        assert bool((x[p : p + n] != MASK_ID).all())
        assert result.tokens.numel() == x.numel() - p  # up to the end of the absolute grid
        assert torch.equal(result.tokens[:n], x[p : p + n])
        _assert_stopped_after(result, n, target.eos_ids)
        decoded.append(n)
    _exercised(results, decoded, config, heavy)


# -- LLaDA ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(("block_length", "tokens_per_step"), GRID)
@pytest.mark.parametrize("heavy", [False, True])
def test_llada_matches_generate(targets, block_length, tokens_per_step, heavy):
    target = targets["llada", heavy]
    config = DecodingConfig(
        gen_length=2 * block_length, block_length=block_length, tokens_per_step=tokens_per_step
    )
    prompts = _prompts()
    results = _decode(target, prompts, config)
    decoded = []
    for prompt, result in zip(prompts, results):
        x = ref.llada_generate(
            target.model,
            prompt,
            mask_id=MASK_ID,
            steps=2 * config.steps_per_block,
            gen_length=config.gen_length,
            block_length=block_length,
        )
        generated = x[prompt.numel() :]
        # LLaDA decodes every block; the project stops after the block holding an EOS
        n = _end_of_eos_block(generated, block_length, target.eos_ids)
        assert torch.equal(result.tokens[:n], generated[:n])
        _assert_stopped_after(result, n, target.eos_ids)
        decoded.append(n)
    _exercised(results, decoded, config, heavy)


# -- LLaDA2.0 -----------------------------------------------------------------------------------
@pytest.mark.parametrize(("block_length", "tokens_per_step"), GRID)
@pytest.mark.parametrize("rule", ["static", "sdar_dynamic"])
@pytest.mark.parametrize("heavy", [False, True])
def test_llada2_matches_generate(targets, block_length, tokens_per_step, rule, heavy):
    target = targets["llada2", heavy]
    (eos_id,) = target.eos_ids
    prompts = _prompts()
    # a threshold of 1: nothing passes, LLaDA2.0's rule is then the static one
    config, threshold = _block_rule(target, prompts, block_length, tokens_per_step, rule)
    results = _decode(target, prompts, config)
    decoded = []
    for prompt, result in zip(prompts, results):
        answer = ref.llada2_generate(
            target.model,
            prompt,
            mask_id=MASK_ID,
            eos_id=eos_id,
            gen_length=config.gen_length,
            block_length=block_length,
            steps=config.steps_per_block,
            threshold=threshold,
        )
        # LLaDA2.0 returns the answer up to its first EOS; the project decodes the rest of
        # that block (as LLaDA2.0 does before it cuts) and fills the tail with EOS
        assert torch.equal(result.tokens[: answer.numel()], answer)
        p = prompt.numel()
        first_block = p // block_length * block_length
        n = _end_of_eos_block(
            torch.cat([prompt[first_block:], result.tokens]), block_length, target.eos_ids
        )
        n -= p - first_block
        _assert_stopped_after(result, n, target.eos_ids)
        decoded.append(n)
    _exercised(results, decoded, config, heavy)


# -- Fast-dLLM's threshold rule: LLaDA's sampler, and Dream's block sampler ---------------------
# Dream's includes the opening commit of each block's first position
FAST_DLLM = {"llada": ref.fast_dllm_generate, "dream": ref.dream_block_generate}


@pytest.mark.parametrize("family", sorted(FAST_DLLM))
@pytest.mark.parametrize("block_length", [4, 8])
@pytest.mark.parametrize("quantile", [0.5, 0.8])
@pytest.mark.parametrize("heavy", [False, True])
def test_threshold_rule_matches_fast_dllm(targets, family, block_length, quantile, heavy):
    target = targets[family, heavy]
    prompts = _prompts()
    config = DecodingConfig(gen_length=2 * block_length, block_length=block_length)
    threshold = _confidence_quantile(target, prompts, config, quantile)
    config = replace(config, rule="threshold", threshold=threshold)
    results = _decode(target, prompts, config)
    decoded = []
    for prompt, result in zip(prompts, results):
        x = FAST_DLLM[family](
            target.model,
            prompt,
            mask_id=MASK_ID,
            gen_length=config.gen_length,
            block_length=block_length,
            threshold=threshold,
        )
        generated = x[prompt.numel() :]
        n = _end_of_eos_block(generated, block_length, target.eos_ids)
        assert torch.equal(result.tokens[:n], generated[:n])
        _assert_stopped_after(result, n, target.eos_ids)
        decoded.append(n)
    _exercised(results, decoded, config, heavy)


# -- T > 0: the law of the first commit -----------------------------------------------------------
def _first_commit_law(logits: torch.Tensor, temperature: float, top_k: int) -> torch.Tensor:
    """Exact P(first commit = (position p, token v)) [B, V] of SDAR's static rule with one token
    per step over a fully masked block: every position draws from q_p = softmax(top-k(logits
    / T)), and the commit goes to the position whose draw has the largest q_p(draw)."""
    scaled = logits.to(torch.float64) / temperature  # [B, V]
    kth = torch.topk(scaled, top_k).values[:, -1:]
    q = torch.softmax(scaled.masked_fill(scaled < kth, float("-inf")), dim=-1)  # [B, V]
    law = torch.zeros_like(q)
    for p in range(q.shape[0]):
        for v in q[p].nonzero().flatten():
            c = q[p, v]
            below = [(q[r] * (q[r] < c)).sum() for r in range(q.shape[0]) if r != p]
            law[p, v] = c * torch.stack(below).prod()
    return law


def _chi_square(counts: torch.Tensor, law: torch.Tensor) -> tuple[float, float]:
    """Pearson statistic of `counts` against `law` and its critical value at level 1e-4
    (Wilson-Hilferty); cells expecting fewer than 5 draws are pooled, and a draw of a cell
    the law rules out fails outright."""
    counts, law = counts.flatten(), law.flatten()
    assert not bool(counts[law == 0].any())
    expected = law * counts.sum()
    large, small = expected >= 5, (expected < 5) & (law > 0)
    observed = torch.cat([counts[large], counts[small].sum()[None]])
    expected = torch.cat([expected[large], expected[small].sum()[None]])
    if not bool(small.any()):
        observed, expected = observed[:-1], expected[:-1]
    stat = float(((observed - expected) ** 2 / expected).sum())
    df = observed.numel() - 1
    critical = df * (1 - 2 / (9 * df) + 3.719 * (2 / (9 * df)) ** 0.5) ** 3
    return stat, critical


def test_first_commit_distribution_at_positive_temperature(targets):
    """Coupled Gumbel noise (ours) and torch.multinomial (SDAR's sampler) both draw the first
    commit from its exact law, and the same counts reject a nearby law."""
    target = targets["sdar", False]
    draws, temperature, top_k = 400, 0.8, 3
    prompt = _prompts()[1]  # one whole block: the first decoded block is all masks
    config = DecodingConfig(gen_length=4, block_length=4, temperature=temperature, top_k=top_k)
    x = torch.cat([prompt, torch.full((4,), MASK_ID)])[None]
    with torch.no_grad():
        logits = target.model.full_logits(x, ref.block_causal_mask(2, 4))[0, 4:]  # [4, V]
    law = _first_commit_law(logits, temperature, top_k)
    assert torch.isclose(law.sum(), torch.tensor(1.0, dtype=law.dtype))

    ours = torch.zeros_like(law)

    def first_commit(index: int, state: State, logits, successor: State, hidden) -> None:
        if state.step == 0:
            changed = (successor.block(4) != state.block(4)).nonzero().flatten()
            assert changed.numel() == 1
            ours[changed[0], successor.block(4)[changed[0]]] += 1

    requests = [Request(prompt, key=i) for i in range(draws)]
    generate(target, requests, config, trace=first_commit)

    theirs = torch.zeros_like(law)
    generator = torch.Generator().manual_seed(0)
    for _ in range(draws):
        tokens, probs = ref.sdar_sample(logits, temperature, top_k, 1.0, generator)
        position = int(torch.topk(probs, 1).indices)
        theirs[position, tokens[position]] += 1

    for counts in (ours, theirs):
        stat, critical = _chi_square(counts, law)
        assert stat < critical, (stat, critical)
    for counts in (ours, theirs):  # the test can tell laws apart: top-5 instead of top-3
        stat, critical = _chi_square(counts, _first_commit_law(logits, temperature, 5))
        assert stat > critical, (stat, critical)


# -- the real SDAR tokenizer and chat template --------------------------------------------------
def test_real_sdar_tokenizer_chat_prompt_decodes_like_the_reference(tmp_path):
    """The published SDAR-8B-Chat tokenizer files and chat template: the mask and EOS ids the
    project reads from the checkpoint are the tokenizer's `<|MASK|>`, `<|im_end|>` and
    `<|endoftext|>`; a chat prompt decodes on a tiny SDAR of the real vocabulary exactly as
    SDAR's loop decodes it, and stops at the end of the turn."""
    from spot_common.tokenizer import load_tokenizer

    sdar_chat = reference_checkpoint("sdar-8b-chat")
    tokenizer = load_tokenizer(sdar_chat)
    decoding = load_model(sdar_chat, device="meta").decoding
    assert tokenizer.mask_token == "<|MASK|>"
    assert decoding.mask_id == tokenizer.mask_token_id == 151669
    assert decoding.eos_ids == tuple(
        tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    )
    assert decoding.eos_ids == (151645, 151643)

    messages = [{"role": "user", "content": "What is 2 + 3? Answer briefly."}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_end|>\n<|im_start|>assistant\n")
    prompt = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"])
    assert prompt.numel() % 4  # the first decoded block holds the prompt's tail

    vocab_size = json.loads((sdar_chat / "config.json").read_text())["vocab_size"]
    model = random_model(
        "sdar", seed=5, vocab_size=vocab_size, hidden_size=16, intermediate_size=32, num_heads=2
    )

    def reference(model) -> torch.Tensor:
        x = ref.sdar_generate(
            model,
            prompt,
            mask_id=decoding.mask_id,
            gen_length=16,
            block_length=4,
            denoising_steps=4,
            stop_ids=decoding.eos_ids,
        )
        return x[prompt.numel() :]

    with torch.no_grad():
        head = model.lm_head.weight
        head[decoding.mask_id] = head.mean(0)
        # the turn ends where the model would first write its sixth answer token
        sixth = reference(model)[5]
        head[decoding.eos_ids[0]] = 1.05 * head[sixth]
    directory = save_checkpoint(
        tmp_path, family_for("sdar"), model, decoding.mask_id, decoding.eos_ids
    )
    target = load_target(directory)
    assert (target.mask_id, target.eos_ids) == (decoding.mask_id, decoding.eos_ids)

    result = generate(
        target, [Request(prompt, key=0)], DecodingConfig(gen_length=16, block_length=4)
    )[0]
    generated = reference(target.model)
    n = int((generated != decoding.mask_id).sum())
    assert torch.equal(result.tokens[:n], generated[:n])
    _assert_stopped_after(result, n, decoding.eos_ids)
    assert result.finish_reason == "eos" and n < result.tokens.numel()
    assert "<|im_end|>" in tokenizer.decode(result.tokens[:n])
