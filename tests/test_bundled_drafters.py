"""The shipped drafters: each bundled target has SPOT (static rule), Spiffy (static and
threshold rules) and SPOT-Sets (threshold rule) for block lengths 16 and 32, and every one of
them leaves the target's own decoding unchanged on held-out prompts, at T=0 and T=0.8 (float32,
batched; SPOT and Spiffy also in bfloat16)."""

from __future__ import annotations

import pytest
import torch

from pipeline.drafter_data import corpus_prompts, encode, load_model_and_tokenizer
from spot.budget import AutoBudget, ForwardCost, measure_forward_cost
from spot.builtin import builtin_drafter
from spot.config import DecodingConfig
from spot.decode import generate
from spot.drafters.registry import acceptance_curve, load_drafter

TARGETS = ("sdar-tiny", "sdar-nano", "llada-tiny")
DRAFTERS = (
    ("spot", "static"),
    ("spiffy", "static"),
    ("spiffy", "threshold"),
    ("spot-sets", "threshold"),
)
PROMPTS = 3


@pytest.fixture(scope="module", params=TARGETS)
def bundled(request):
    tokenizer, target = load_model_and_tokenizer(f"builtin:{request.param}")
    return request.param, target, encode(tokenizer, corpus_prompts("heldout", PROMPTS))


@pytest.mark.parametrize("block_length", [16, 32])
@pytest.mark.parametrize(("kind", "rule"), DRAFTERS)
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_shipped_drafter_is_lossless(bundled, kind, rule, block_length, temperature):
    name, target, requests = bundled
    config = DecodingConfig(
        gen_length=64, block_length=block_length, rule=rule, temperature=temperature, seed=3
    )
    drafter = load_drafter(kind, builtin_drafter(name, kind, block_length, rule), 8, target)
    plain = generate(target, requests, config)
    drafted = generate(target, requests, config, drafter=drafter)
    for a, b in zip(plain, drafted, strict=True):
        assert torch.equal(a.tokens, b.tokens)
    assert sum(r.stats.nfe for r in drafted) < sum(r.stats.nfe for r in plain)


@pytest.mark.parametrize(("kind", "rule"), DRAFTERS)
def test_auto_budget_of_a_shipped_drafter_is_lossless(bundled, kind, rule):
    name, target, requests = bundled
    config = DecodingConfig(gen_length=64, block_length=32, rule=rule)
    path = builtin_drafter(name, kind, 32, rule)
    curve = acceptance_curve(kind, path)
    assert curve.budgets[0] == 0 and curve.steps_per_forward[0] == 1.0
    assert list(curve.steps_per_forward) == sorted(curve.steps_per_forward)
    cost = measure_forward_cost(target, 32, 64, [1, 2, 4, 8, 17])
    free = ForwardCost(cost.states, tuple(cost.seconds[0] for _ in cost.states))
    drafter = load_drafter(kind, path, max(curve.budgets), target)
    auto = AutoBudget(drafter, curve, free, probe_calls=10**9)  # the start-up choice only
    plain = generate(target, requests, config)
    drafted = generate(target, requests[:1], config, drafter=auto)
    drafted += generate(target, requests[1:], config, drafter=auto)
    assert set(auto.chosen) == {1, 2} and set(auto.chosen.values()) <= set(curve.budgets)
    assert auto.chosen[1] > 0  # wider forwards priced free here: the drafter does draft
    for a, b in zip(plain, drafted, strict=True):
        assert torch.equal(a.tokens, b.tokens)


@pytest.mark.parametrize("name", ["sdar-tiny", "llada-tiny"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_shipped_drafters_are_lossless_in_bfloat16(name, temperature):
    """bfloat16 targets (where the CPU has AMX/AVX-512 BF16, a 17-state verification forward
    costs about a third less than in float32): a tree's node gets the logits it would get
    alone."""
    tokenizer, target = load_model_and_tokenizer(f"builtin:{name}", "bfloat16")
    requests = encode(tokenizer, corpus_prompts("heldout", PROMPTS))
    config = DecodingConfig(gen_length=64, block_length=32, temperature=temperature, seed=3)
    plain = generate(target, requests, config)
    for kind in ("spot", "spiffy"):
        drafter = load_drafter(kind, builtin_drafter(name, kind, 32, "static"), 16, target)
        drafted = generate(target, requests, config, drafter=drafter)
        for a, b in zip(plain, drafted, strict=True):
            assert torch.equal(a.tokens, b.tokens)
        assert sum(r.stats.nfe for r in drafted) < sum(r.stats.nfe for r in plain)
