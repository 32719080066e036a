"""On a machine with CUDA: the shipped drafters with the target on the GPU are lossless, at
T=0 and T=0.8, also with budget auto. Skipped elsewhere; on CPU-only
machines `tests/test_drafter_devices.py` covers the device handling with a stand-in device.

    .venv/bin/python -m pytest tests/test_gpu.py tests/test_commit_rules.py -k "gpu or cuda"
"""

from __future__ import annotations

import pytest
import torch

from pipeline.drafter_data import corpus_prompts, encode
from pipeline.tokenizer import load_tokenizer
from spot.budget import AutoBudget, measure_forward_cost
from spot.builtin import builtin_drafter, resolve_builtin
from spot.config import DecodingConfig
from spot.decode import generate
from spot.drafters.registry import acceptance_curve, load_drafter
from spot.models.loading import load_target

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
