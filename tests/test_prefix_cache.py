"""The prefix cache (docs/design.md §1.2): its tree by hand, then on real block-causal targets,
where decoding with it is token-identical to decoding without it, in float64: SDAR (the
bundled sdar-tiny with its shipped drafters, T=0 and T=0.8, batched continuously, prompts
that share a system prompt, the same prompt twice, prompts that share nothing, a cache reused
by a second call and one too small to hold a prompt) and a tiny LLaDA2.0. Bidirectional
targets refuse a prefix cache."""

from __future__ import annotations

import pytest
import torch

from pipeline.drafter_data import corpus_prompts, encode, load_model_and_tokenizer
from spot.builtin import builtin_drafter
from spot.config import DecodingConfig
from spot.decode import Request, generate
from spot.drafters.registry import load_drafter
from spot.models.loading import load_target
from spot.models.prefix_cache import PrefixCache
from spot.target import Window
from tests.test_models_dream_llada2 import write_checkpoint as write_moe_checkpoint
from tests.tiny_checkpoints import write_checkpoint

B = 16  # block length of the decoding tests


# -- the tree, by hand --------------------------------------------------------------------------
def _kv(tokens: list[int], layers: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (k, v) [1, n, 1] holding each position's token (v negated), 8 bytes each."""
    k = torch.tensor(tokens, dtype=torch.float64)[None, :, None]
    return [(k + layer, -k - layer) for layer in range(layers)]


def _found(cache: PrefixCache, tokens: list[int]) -> list[int]:
    """The tokens whose KV a lookup returns (layer 0's keys), in order."""
    pieces = cache.lookup(torch.tensor(tokens))
    return [int(x) for piece in pieces for x in piece[0][0].flatten()]


def test_a_lookup_finds_the_longest_cached_prefix_in_whole_blocks():
    cache = PrefixCache(10_000, block_length=2)
    assert _found(cache, [1, 2, 3, 4]) == []
    cache.insert(torch.tensor([1, 2, 3, 4, 5, 6]), _kv([1, 2, 3, 4, 5, 6]))
    assert _found(cache, [1, 2, 3, 4, 5, 6, 7, 8]) == [1, 2, 3, 4, 5, 6]
    assert _found(cache, [1, 2, 3, 9, 5, 6]) == [1, 2]  # the block holding 9 differs
    assert _found(cache, [1, 2, 3]) == [1, 2]  # whole blocks only
    assert _found(cache, [2, 2, 3, 4]) == []
    pieces = cache.lookup(torch.tensor([1, 2, 3, 4]))
    assert [torch.equal(v, -k) for k, v in pieces[0]] == [True, True]
    assert [int(k[0, 0, 0]) for k, _ in pieces[0]] == [1, 2]  # each layer its own KV
    stats = cache.stats
    assert (stats.lookups, stats.hits, stats.tokens_reused) == (6, 4, 6 + 2 + 2 + 4)
    assert (stats.tokens_stored, stats.nodes, stats.bytes) == (6, 1, 6 * 8 * 2 * 2)


def test_an_edge_splits_where_two_prompts_part_and_both_stay_whole():
    cache = PrefixCache(10_000, block_length=2)
    cache.insert(torch.tensor([1, 2, 3, 4, 5, 6]), _kv([1, 2, 3, 4, 5, 6]))
    cache.insert(torch.tensor([1, 2, 3, 4, 7, 8, 9, 9]), _kv([1, 2, 3, 4, 7, 8, 9, 9]))
    assert cache.stats.nodes == 3 and cache.stats.tokens_stored == 6 + 4
    assert _found(cache, [1, 2, 3, 4, 5, 6]) == [1, 2, 3, 4, 5, 6]
    assert _found(cache, [1, 2, 3, 4, 7, 8, 9, 9, 1]) == [1, 2, 3, 4, 7, 8, 9, 9]
    assert _found(cache, [1, 2, 3, 4, 7, 8, 0, 0]) == [1, 2, 3, 4, 7, 8]
    cache.insert(torch.tensor([1, 2, 3, 4]), _kv([1, 2, 3, 4]))  # already there
    assert cache.stats.nodes == 3 and cache.stats.tokens_stored == 10
    assert cache.stats.bytes == 10 * 8 * 2 * 2


def test_the_least_recently_used_leaves_go_first_when_over_the_budget():
    per_token = 8 * 2 * 2  # float64 keys and values of 2 layers
    cache = PrefixCache(8 * per_token, block_length=2)
    cache.insert(torch.tensor([1, 1, 2, 2]), _kv([1, 1, 2, 2]))
    cache.insert(torch.tensor([1, 1, 3, 3]), _kv([1, 1, 3, 3]))  # splits: [1 1] -> two leaves
    assert _found(cache, [1, 1, 2, 2]) == [1, 1, 2, 2]  # [2 2] now used after [3 3]
    cache.insert(torch.tensor([5, 5, 6, 6]), _kv([5, 5, 6, 6]))  # 10 tokens: one leaf goes
    assert cache.stats.tokens_evicted == 2 and cache.stats.bytes == 8 * per_token
    assert _found(cache, [1, 1, 3, 3]) == [1, 1]
    assert _found(cache, [1, 1, 2, 2]) == [1, 1, 2, 2]
    cache.insert(torch.tensor(list(range(10, 20))), _kv(list(range(10, 20))))  # over budget
    assert _found(cache, list(range(10, 20))) == []  # the largest leaf could not stay
    assert cache.stats.bytes <= 8 * per_token


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="budget_bytes"):
        PrefixCache(-1, 16)
    with pytest.raises(ValueError, match="block_length"):
        PrefixCache(100, 0)
    cache = PrefixCache(100, 2)
    with pytest.raises(ValueError, match="whole blocks"):
        cache.insert(torch.tensor([1, 2, 3]), _kv([1, 2, 3]))
    cache.claim(cache)
    with pytest.raises(ValueError, match="one target"):
        cache.claim(object())


# -- on a tiny SDAR and a tiny LLaDA -----------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("checkpoints")
    return {
        family: load_target(write_checkpoint(root / family, family, 11))
        for family in ("sdar", "llada")
    }


def _tokens(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 290, (n,), generator=torch.Generator().manual_seed(seed))


def test_a_context_opened_from_the_cache_scores_as_a_fresh_one(tiny):
    """The KV of a prompt's whole blocks, stored by one request's first forward, gives the
    next request with the same blocks the logits a fresh context gives."""
    target = tiny["sdar"]
    cache = PrefixCache(1 << 20, block_length=4)
    shared = _tokens(12, seed=1)
    first, second = (torch.cat([shared, _tokens(5, seed)]) for seed in (2, 3))
    window = torch.cat([second[:16], second[16:], _tokens(3, 4)])  # whole blocks, first block
    fresh = target.open(second, 24)
    expected = target.score([fresh], [Window(0, window, 16)], 4).logits
    warm = target.open(first, 24, cache)
    assert target.committed_length(warm) == 0
    target.score([warm], [Window(0, torch.cat([first, _tokens(3, 5)]), 16)], 4)
    assert cache.stats.tokens_stored == 16
    reused = target.open(second, 24, cache)
    assert target.committed_length(reused) == 12  # where second parts from first
    logits = target.score([reused], [Window(0, window[12:], 4)], 4).logits
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-10)
    assert cache.stats.tokens_stored == 16 + 4  # its own whole block, stored too


def test_prefixes_opened_together_are_computed_once(tiny):
    """Three contexts opened together: the two that share blocks get them from one row of one
    forward, the third keeps its prompt for its own first forward."""
    target = tiny["sdar"]
    cache = PrefixCache(1 << 20, block_length=4)
    shared = _tokens(8, seed=1)
    prompts = [torch.cat([shared, _tokens(6, 2)]), torch.cat([shared, _tokens(3, 3)])]
    prompts.append(_tokens(10, seed=4))
    contexts = [target.open(p, 24, cache) for p in prompts]
    assert target.prefill_shared(contexts) == [8, 0, 0]
    assert [target.committed_length(c) for c in contexts] == [8, 8, 0]
    assert cache.stats.tokens_stored == 8
    for ctx, prompt in zip(contexts, prompts, strict=True):
        fresh = target.open(prompt, 24)
        start = target.committed_length(ctx)
        whole = prompt.numel() // 4 * 4
        window = torch.cat([prompt, _tokens(whole + 4 - prompt.numel(), 9)])
        expected = target.score([fresh], [Window(0, window, whole)], 4).logits
        logits = target.score([ctx], [Window(0, window[start:], whole - start)], 4).logits
        torch.testing.assert_close(logits, expected, rtol=0, atol=1e-10)


def test_bidirectional_targets_have_no_prefix_cache(tiny):
    target = tiny["llada"]
    assert "bidirectional" in target.prefix_cache_problem
    assert tiny["sdar"].prefix_cache_problem is None
    cache = PrefixCache(1 << 20, block_length=4)
    with pytest.raises(ValueError, match="no prefix cache: bidirectional"):
        target.open(_tokens(6, 1), 16, cache)
    request = Request(_tokens(6, 1), key=1)
    config = DecodingConfig(gen_length=8, block_length=4)
    with pytest.raises(ValueError, match="no prefix cache for this target: bidirectional"):
        generate(target, [request], config, prefix_cache=cache)
    [result] = generate(target, [request], config)  # nothing of a prompt is ever kept
    stats = result.stats
    assert (stats.prompt_tokens_reused, stats.prompt_tokens_computed) == (0, 0)
    assert stats.prefill_seconds == 0


def test_a_cache_serves_its_own_block_length(tiny):
    request = Request(_tokens(6, 1), key=1)
    config = DecodingConfig(gen_length=8, block_length=4)
    with pytest.raises(ValueError, match="block length 8 cannot serve block_length 4"):
        generate(tiny["sdar"], [request], config, prefix_cache=PrefixCache(1 << 20, 8))


# -- decoding on the bundled sdar-tiny ---------------------------------------------------------
@pytest.fixture(scope="module")
def sdar_tiny():
    """The target and requests: three behind one system prompt, one of them twice (two
    samples), one behind another system prompt, two with none."""
    tokenizer, target = load_model_and_tokenizer("builtin:sdar-tiny", "float64")
    plain = encode(tokenizer, corpus_prompts("heldout", 6))
    system = [
        torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"])
        for text in ("Think it through, then answer. " * 2, "Be brief. ")
    ]
    requests = [Request(torch.cat([system[0], r.prompt]), r.key) for r in plain[:3]]
    requests.insert(2, Request(requests[1].prompt, key=7))
    requests.append(Request(torch.cat([system[1], plain[3].prompt]), plain[3].key))
    requests += plain[4:]
    return target, requests


def _shared_blocks(a: torch.Tensor, b: torch.Tensor) -> int:
    """The positions of the whole blocks two prompts share, each prompt's own last partial
    block excluded."""
    n = min(a.numel() // B, b.numel() // B) * B
    differs = (a[:n] != b[:n]).nonzero()
    return int(differs[0]) // B * B if differs.numel() else n


@pytest.fixture(scope="module")
def uncached(sdar_tiny):
    """config -> results without a cache, batched continuously, made once."""
    target, requests = sdar_tiny
    made = {}

    def results(config: DecodingConfig):
        if config not in made:
            made[config] = generate(target, requests, config, max_active=3)
        return made[config]

    return results


def _tokens_of(results) -> list[list[int]]:
    return [r.tokens.tolist() for r in results]


def _check_prompt_stats(requests, results, block_length: int) -> None:
    """Every whole block of every prompt is either computed or reused, in some request's
    name; time goes with what was computed."""
    for request, result in zip(requests, results, strict=True):
        stats = result.stats
        whole = request.prompt.numel() // block_length * block_length
        assert stats.prompt_tokens_reused + stats.prompt_tokens_computed == whole
        assert (stats.prefill_seconds > 0) == (stats.prompt_tokens_computed > 0)


@pytest.mark.parametrize(
    ("kind", "rule"),
    [(None, "static"), ("spot", "static"), ("spiffy", "static"), ("spot-sets", "threshold")],
)
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_decoding_with_the_cache_is_token_identical(sdar_tiny, uncached, kind, rule, temperature):
    target, requests = sdar_tiny
    config = DecodingConfig(gen_length=64, block_length=B, rule=rule, temperature=temperature)
    expected = uncached(config)
    assert len({r.stats.nfe for r in expected}) > 2  # requests leave at different iterations
    drafter = (
        None
        if kind is None
        else load_drafter(kind, builtin_drafter("sdar-tiny", kind, B, rule), 4, target)
    )
    cache = PrefixCache(1 << 30, block_length=B)
    results = generate(target, requests, config, drafter, max_active=3, prefix_cache=cache)
    assert _tokens_of(results) == _tokens_of(expected)
    assert [r.finish_reason for r in results] == [r.finish_reason for r in expected]
    _check_prompt_stats(requests, results, B)
    _check_prompt_stats(requests, expected, B)
    assert sum(r.stats.prompt_tokens_reused for r in expected) == 0
    # the first three are admitted together: the blocks all three share are computed once,
    # then those the two samples of one prompt share; the fourth finds its blocks cached
    reused = [r.stats.prompt_tokens_reused for r in results]
    p = [r.prompt for r in requests]
    system = _shared_blocks(p[0], p[1])
    assert system >= 2 * B
    cached = max(_shared_blocks(p[3], p[0]), _shared_blocks(p[3], p[1]))
    assert reused == [0, system, p[2].numel() // B * B, cached, 0, 0, 0]
    computed = sum(r.stats.prompt_tokens_computed for r in results)
    assert computed == sum(r.stats.prompt_tokens_computed for r in expected) - sum(reused)


def test_a_second_call_reuses_the_cache_and_a_tiny_one_evicts(sdar_tiny, uncached):
    target, requests = sdar_tiny
    config = DecodingConfig(gen_length=64, block_length=B, temperature=0.8)
    expected = _tokens_of(uncached(config))
    cache = PrefixCache(1 << 30, block_length=B)
    generate(target, requests, config, max_active=3, prefix_cache=cache)
    again = generate(target, requests, config, max_active=2, prefix_cache=cache)
    assert _tokens_of(again) == expected
    assert all(r.stats.prompt_tokens_computed == 0 for r in again)  # every prompt cached
    block_bytes = cache.stats.bytes // cache.stats.tokens_stored * B
    for budget in (0, block_bytes):
        small = PrefixCache(budget, block_length=B)
        results = generate(target, requests, config, max_active=3, prefix_cache=small)
        assert _tokens_of(results) == expected
        assert small.stats.bytes <= budget and small.stats.tokens_evicted > 0
        _check_prompt_stats(requests, results, B)
        # what requests admitted together share is computed once even with nothing cached
        p = [r.prompt for r in requests]
        assert (
            sum(r.stats.prompt_tokens_reused for r in results[:3])
            == _shared_blocks(p[0], p[1]) + p[2].numel() // B * B
        )


def test_llada2_decodes_with_the_cache_as_without(tmp_path):
    """LLaDA2.0 (MoE, absolute grid, block-causal): the same, on a tiny random checkpoint."""
    target = load_target(write_moe_checkpoint(tmp_path, "llada2", seed=11))
    shared = _tokens(13, seed=1)
    prompts = [torch.cat([shared, _tokens(n, n)]) for n in (2, 5, 9)] + [_tokens(7, 2)]
    requests = [Request(p, key=i) for i, p in enumerate(prompts)]
    for temperature in (0.0, 0.8):
        config = DecodingConfig(gen_length=16, block_length=4, temperature=temperature)
        expected = generate(target, requests, config, max_active=2)
        cache = PrefixCache(1 << 20, block_length=4)
        results = generate(target, requests, config, max_active=2, prefix_cache=cache)
        assert _tokens_of(results) == _tokens_of(expected)
        assert [r.stats.prompt_tokens_reused for r in results] == [0, 12, 12, 0]
