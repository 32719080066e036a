"""On a machine with CUDA: the shipped drafters with the target on the GPU are lossless, at
T=0 and T=0.8, also with budget auto, and so is decoding with a prefix cache. Skipped
elsewhere; on CPU-only machines `tests/test_drafter_devices.py` covers the device handling
with a stand-in device.

    .venv/bin/python -m pytest tests/test_gpu.py tests/test_commit_rules.py -k "gpu or cuda"
"""

from __future__ import annotations

import pytest
import torch

from pipeline.drafter_data import corpus_prompts, encode
from spot.budget import AutoBudget, measure_forward_cost
from spot.builtin import builtin_drafter, resolve_builtin
from spot.config import DecodingConfig
from spot.decode import Request, generate
from spot.drafters.registry import acceptance_curve, load_drafter
from spot.models.loading import load_target
from spot.models.prefix_cache import PrefixCache
from spot_common.tokenizer import load_tokenizer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def on_gpu():
    local = resolve_builtin("builtin:sdar-tiny")
    target = load_target(local, dtype=torch.float32, device="cuda")
    return target, encode(load_tokenizer(local), corpus_prompts("heldout", 4))


@pytest.mark.parametrize(
    ("kind", "rule"),
    [("spot", "static"), ("spiffy", "static"), ("spiffy", "threshold"), ("spot-sets", "threshold")],
)
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_shipped_drafters_are_lossless_on_the_gpu(on_gpu, kind, rule, temperature):
    target, requests = on_gpu
    assert target.device.type == "cuda"
    config = DecodingConfig(gen_length=64, block_length=32, rule=rule, temperature=temperature)
    drafter = load_drafter(kind, builtin_drafter("sdar-tiny", kind, 32, rule), 8, target)
    plain = generate(target, requests, config)
    drafted = generate(target, requests, config, drafter=drafter)
    assert [r.tokens.tolist() for r in drafted] == [r.tokens.tolist() for r in plain]
    assert sum(r.stats.nfe for r in drafted) < sum(r.stats.nfe for r in plain)


def test_budget_auto_on_the_gpu(on_gpu):
    target, requests = on_gpu
    path = builtin_drafter("sdar-tiny", "spot", 32, "static")
    cost = measure_forward_cost(target, 32, 64, [1, 2, 4, 8, 17])
    auto = AutoBudget(load_drafter("spot", path, 16, target), acceptance_curve("spot", path), cost)
    config = DecodingConfig(gen_length=64, block_length=32, temperature=0.8)
    plain = generate(target, requests, config)
    drafted = generate(target, requests, config, drafter=auto)
    assert [r.tokens.tolist() for r in drafted] == [r.tokens.tolist() for r in plain]


def test_prefix_cache_on_the_gpu(on_gpu):
    """The prefix cache holds its KV on the GPU; decoding with it, draft-free and with SPOT,
    gives what decoding without it gives, and the shared system prompt is computed once."""
    target, requests = on_gpu
    system = torch.arange(10, 10 + 70)  # 70 token ids in front of every prompt
    shared = [Request(torch.cat([system, r.prompt]), r.key) for r in requests]
    config = DecodingConfig(gen_length=64, block_length=32, temperature=0.8)
    drafter = load_drafter("spot", builtin_drafter("sdar-tiny", "spot", 32, "static"), 8, target)
    for decoder in (None, drafter):
        plain = generate(target, shared, config, decoder, max_active=2)
        cache = PrefixCache(1 << 30, block_length=32)
        cached = generate(target, shared, config, decoder, max_active=2, prefix_cache=cache)
        assert [r.tokens.tolist() for r in cached] == [r.tokens.tolist() for r in plain]
        assert [r.stats.prompt_tokens_reused for r in cached][1:] == [64] * (len(shared) - 1)
        assert cache.stats.bytes > 0
        [[(keys, _), *_]] = cache.lookup(shared[0].prompt[:64])
        assert keys.device.type == "cuda"


def test_order_model_trains_on_the_gpu_and_comes_back_on_the_cpu():
    """What a learner with a GPU does (drafter.learning.num_gpus): the same training on
    CUDA fits as well as on the CPU, and the model it returns drafts on the CPU."""
    from spot.drafters.training import root_samples, train_order_model
    from tests.test_spot_drafter import SMALL, ToyTarget, record, requests

    traj = record(
        ToyTarget(seed=3, sharpness=4.0),
        requests(24, seed=5),
        DecodingConfig(gen_length=32, block_length=8),
    )
    train, held = (root_samples(t, SMALL) for t in traj.split(0.25))
    on_cpu = train_order_model(train, held, SMALL, epochs=3, validation=held)[1]
    model, on_gpu = train_order_model(train, held, SMALL, epochs=3, validation=held, device="cuda")
    assert {p.device.type for p in model.parameters()} == {"cpu"}
    accuracy = "heldout_next_commit_accuracy"
    assert on_gpu[accuracy] > 0.4 and abs(on_gpu[accuracy] - on_cpu[accuracy]) < 0.05
