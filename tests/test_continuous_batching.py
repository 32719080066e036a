"""Continuous batching on the bundled sdar-tiny target: whatever the number of requests
decoding at once, each request's output is what SDAR's own loop gives (T=0) and what one
static batch gives (T=0 and T=0.8, draft-free and with the shipped drafters), in float64,
where equal inputs give equal decisions whatever shares the forward. Held-out prompts end
after 23 to 55 forwards, so requests leave and enter at different iterations."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from pipeline.drafter_data import corpus_prompts, encode, load_model_and_tokenizer
from spot.budget import AutoBudget, ForwardCost
from spot.builtin import builtin_drafter
from spot.config import DecodingConfig
from spot.decode import generate, stream
from spot.drafters.registry import acceptance_curve, load_drafter
from tests import reference_loops as ref

PROMPTS = 6


@pytest.fixture(scope="module")
def sdar_tiny():
    """The target and its requests, decoded on one thread (a tiny model: faster so on a
    shared machine)."""
    tokenizer, target = load_model_and_tokenizer("builtin:sdar-tiny", "float64")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield target, encode(tokenizer, corpus_prompts("heldout", PROMPTS))
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def static(sdar_tiny):
    """config -> draft-free results of all the requests in one batch, made once."""
    target, requests = sdar_tiny
    made = {}

    def results(config: DecodingConfig):
        if config not in made:
            made[config] = generate(target, requests, config)
        return made[config]

    return results


def _tokens(results) -> list[list[int]]:
    return [r.tokens.tolist() for r in results]


def test_continuous_batching_gives_what_sdars_own_loop_gives(sdar_tiny):
    target, requests = sdar_tiny
    config = DecodingConfig(gen_length=64, block_length=32)
    results = generate(target, requests, config, max_active=3)
    for request, result in zip(requests, results, strict=True):
        prompt = request.prompt
        x = ref.sdar_generate(
            target.model,
            prompt,
            mask_id=target.mask_id,
            gen_length=config.gen_length,
            block_length=config.block_length,
            denoising_steps=config.steps_per_block,
            stop_ids=target.eos_ids,
        )
        p = prompt.numel()
        n = int((x[p:] != target.mask_id).sum())  # the reference leaves masks after its stop
        assert torch.equal(result.tokens[:n], x[p : p + n])
        assert bool((result.tokens[n:] == target.eos_ids[0]).all())


def _drafter(kind: str | None, target, rule: str):
    if kind is None:
        return None
    if kind == "spot auto":  # the start-up choice and the search, forwards priced free
        path = builtin_drafter("sdar-tiny", "spot", 32, rule)
        curve = acceptance_curve("spot", path)
        drafter = load_drafter("spot", path, max(curve.budgets), target)
        return AutoBudget(drafter, curve, ForwardCost((1, 64), (0.01, 0.01)), probe_calls=2)
    return load_drafter(kind, builtin_drafter("sdar-tiny", kind, 32, rule), 4, target)


@pytest.mark.parametrize(
    ("kind", "rule"),
    [(None, "static"), ("spot", "static"), ("spiffy", "static"), ("spot auto", "static")]
    + [(None, "threshold"), ("spot-sets", "threshold")],
)
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_continuous_batching_is_token_identical_to_a_static_batch(
    sdar_tiny, static, kind, rule, temperature
):
    target, requests = sdar_tiny
    config = DecodingConfig(gen_length=64, block_length=32, rule=rule, temperature=temperature)
    expected = static(config)
    assert len({r.stats.nfe for r in expected}) > 2
    for max_active in (1, 2) if kind is None else (2,):
        drafter = _drafter(kind, target, rule)
        results = generate(target, requests, config, drafter, max_active=max_active)
        assert _tokens(results) == _tokens(expected)
        assert [r.finish_reason for r in results] == [r.finish_reason for r in expected]
        if drafter is not None:
            assert sum(r.stats.nfe for r in results) < sum(r.stats.nfe for r in expected)


@pytest.mark.parametrize("kind", [None, "spot"])
def test_a_source_with_nothing_waiting_now_and_then(sdar_tiny, static, kind):
    """A request source that often has nothing waiting (None), as a replica's queue between
    its calls: the loop decodes what it has, asks again each iteration, takes requests as
    they come (none active: it asks again at once) and ends when the source ends; indices
    count requests only, and every request's tokens are a static batch's."""
    target, requests = sdar_tiny
    config = DecodingConfig(gen_length=64, block_length=32, temperature=0.8)
    expected = static(config)
    asked = {"none": 0}

    def source():
        for i, request in enumerate(requests):
            for _ in range(8 if i == 0 else 40 * (i % 2)):  # nothing now, at times for long
                asked["none"] += 1
                yield None
            yield request
        for _ in range(5):
            asked["none"] += 1
            yield None

    drafter = _drafter(kind, target, "static")
    results = dict(stream(target, source(), config, drafter, max_active=2))
    assert asked["none"] == 8 + 40 * (len(requests) // 2) + 5
    assert sorted(results) == list(range(len(requests)))
    assert _tokens(results[i] for i in range(len(requests))) == _tokens(expected)


@pytest.mark.parametrize("kind", [None, "spot"])
def test_a_stop_check_ends_a_request_after_its_block(sdar_tiny, static, kind):
    """A stop check is asked after each block a request completes, with its generated ids:
    where it says stop (even requests), the request ends after that block ("stop") with
    the tokens the unstopped decoding has there, EOS after them, in fewer forwards; where
    it does not (odd requests), the output is the unstopped one. Draft-free and drafted,
    batched continuously."""
    target, requests = sdar_tiny
    config = DecodingConfig(gen_length=64, block_length=32, temperature=0.8)
    expected = static(config)
    seen: dict[int, list[int]] = {i: [] for i in range(len(requests))}

    def check(i: int):
        def stop(ids: torch.Tensor) -> bool:
            seen[i].append(ids.numel())
            assert ids.tolist() == expected[i].tokens[: ids.numel()].tolist()
            return i % 2 == 0

        return stop

    stopping = [replace(r, stop=check(i)) for i, r in enumerate(requests)]
    drafter = _drafter(kind, target, "static")
    results = generate(target, stopping, config, drafter, max_active=2)
    asked = [i for i in range(len(requests)) if seen[i]]  # their first block did not end them
    assert any(i % 2 == 0 for i in asked) and any(i % 2 for i in asked)
    for i, (result, unstopped) in enumerate(zip(results, expected, strict=True)):
        if i % 2 == 0 and seen[i]:
            [kept] = seen[i]
            assert 0 < kept < 64 and result.finish_reason == "stop"
            assert result.tokens[:kept].tolist() == unstopped.tokens[:kept].tolist()
            assert bool((result.tokens[kept:] == target.eos_ids[0]).all())
            assert result.stats.nfe < unstopped.stats.nfe
        else:
            assert result.tokens.tolist() == unstopped.tokens.tolist()
            assert result.finish_reason == unstopped.finish_reason


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_drafters_swapped_between_iterations_change_no_token(sdar_tiny, static, temperature):
    """A job that learns its drafter hands new ones to a running loop (`DrafterSlot`): taken
    at the next iteration, whatever the requests' blocks and steps. Every request decoded
    partly with one drafter, partly with others (draft-free, Spiffy, SPOT under auto
    budgets, a drafter guessing at random) has a static batch's tokens."""
    from spot.drafting import DrafterSlot
    from tests.random_drafter import RandomDrafter

    target, requests = sdar_tiny
    config = DecodingConfig(gen_length=64, block_length=32, temperature=temperature)
    expected = static(config)
    drafters = [
        None,
        _drafter("spiffy", target, "static"),
        RandomDrafter(seed=3),
        _drafter("spot", target, "static"),
    ]
    slot = DrafterSlot()
    walks = {"seen": 0}

    def swap(index, tree, path):  # called within an iteration: the swap is at the next one
        walks["seen"] += 1
        if walks["seen"] % 5 == 0:
            slot.put(drafters[walks["seen"] // 5 % len(drafters)])

    results = generate(target, requests, config, slot, on_walk=swap, max_active=3)
    assert slot.swaps >= 2 * len(drafters)
    assert _tokens(results) == _tokens(expected)
    assert [r.finish_reason for r in results] == [r.finish_reason for r in expected]
    assert sum(r.stats.nfe for r in results) < sum(r.stats.nfe for r in expected)
    with pytest.raises(ValueError, match="hidden"):
        slot.put(type("Reads", (RandomDrafter,), {"needs_hidden": True})())
