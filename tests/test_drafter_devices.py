"""A target whose scores live on another device than the CPU (a GPU target's do): drafters
grow the trees the CPU gives and the decode loop's output is the CPU's. torch's lazy
TorchScript backend stands in for the GPU: it runs on the CPU but, like CUDA, refuses to mix
its tensors with the CPU's."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pipeline.drafter_data import corpus_prompts, encode, load_model_and_tokenizer
from spot.budget import AutoBudget, measure_forward_cost
from spot.builtin import builtin_drafter
from spot.config import DecodingConfig
from spot.decode import generate
from spot.drafters.registry import acceptance_curve, load_drafter
from spot.drafters.spiffy import DraftGraph, SpiffyDrafter
from spot.drafting import Drafter, StepNoise


@pytest.fixture(scope="module")
def device():
    from torch._lazy import ts_backend

    ts_backend.init()
    return torch.device("lazy")


@pytest.fixture(scope="module")
def sdar_tiny():
    tokenizer, target = load_model_and_tokenizer("builtin:sdar-tiny")
    return target, encode(tokenizer, corpus_prompts("heldout", 2))


class _Recording(Drafter):
    """Passes proposals to a drafter and keeps every input."""

    def __init__(self, drafter):
        self.drafter = drafter
        self.needs_hidden = drafter.needs_hidden
        self.inputs = []

    def propose(self, inputs, noise, batch_size):
        self.inputs.extend(inputs)
        return self.drafter.propose(inputs, noise, batch_size)


def _alone(drafter, inp):
    """The drafter's tree for one input, with noise of its own (drawn where its logits are)."""
    return drafter.propose([inp], StepNoise(inp.config.seed, inp.config.temperature), 1)[0]


@pytest.mark.parametrize(
    ("kind", "rule"), [("spot", "static"), ("spiffy", "static"), ("spot-sets", "threshold")]
)
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_trees_do_not_depend_on_where_the_stale_tensors_live(
    device, sdar_tiny, kind, rule, temperature
):
    target, requests = sdar_tiny
    config = DecodingConfig(gen_length=32, block_length=32, rule=rule, temperature=temperature)
    path = builtin_drafter("sdar-tiny", kind, 32, rule)
    drafter = load_drafter(kind, path, 8, target)
    if kind == "spiffy":  # with dynamic pruning, which reads the stale probabilities too
        drafter = SpiffyDrafter(DraftGraph.load(path), budget=12, keep=6)
    recording = _Recording(drafter)
    for request in requests:
        generate(target, [request], config, drafter=recording)
    grown = 0
    for inp in recording.inputs[:8]:
        on_cpu = _alone(drafter, inp)
        hidden = None if inp.stale_hidden is None else inp.stale_hidden.to(device)
        logits = inp.stale_logits.to(device)
        moved = dataclasses.replace(inp, stale_logits=logits, stale_hidden=hidden)
        elsewhere = _alone(drafter, moved)
        assert elsewhere.parent == on_cpu.parent
        assert all(a.same_as(b) for a, b in zip(elsewhere.nodes, on_cpu.nodes, strict=True))
        grown += len(on_cpu.nodes) > 1
    assert grown >= 3


class _ScoresElsewhere:
    """The CPU target with its scores moved to `device`, as a GPU target returns them."""

    def __init__(self, target, device):
        self.target, self.device = target, device

    def __getattr__(self, name):
        return getattr(self.target, name)

    def score(self, contexts, windows, block_length, output_hidden=False):
        scores = self.target.score(contexts, windows, block_length, output_hidden)
        hidden = None if scores.hidden is None else scores.hidden.to(self.device)
        return dataclasses.replace(scores, logits=scores.logits.to(self.device), hidden=hidden)


@pytest.mark.parametrize(
    ("kind", "rule"), [(None, "static"), ("spot", "static"), ("spot-sets", "threshold")]
)
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_decoding_with_scores_on_another_device_is_the_cpus(
    device, sdar_tiny, kind, rule, temperature
):
    target, requests = sdar_tiny
    elsewhere = _ScoresElsewhere(target, device)
    config = DecodingConfig(gen_length=32, block_length=32, rule=rule, temperature=temperature)
    expected = [r.tokens.tolist() for r in generate(target, requests, config)]
    drafter = None
    if kind is not None:
        path = builtin_drafter("sdar-tiny", kind, 32, rule)
        drafter = load_drafter(kind, path, 4, elsewhere)
    results = generate(elsewhere, requests, config, drafter=drafter)
    assert [r.tokens.tolist() for r in results] == expected
    if kind == "spot":  # trees were accepted, not only proposed
        assert sum(r.stats.steps for r in results) > sum(r.stats.nfe for r in results)


def test_budget_auto_times_a_target_whose_scores_live_elsewhere(device, sdar_tiny):
    target, requests = sdar_tiny
    elsewhere = _ScoresElsewhere(target, device)
    cost = measure_forward_cost(elsewhere, 32, 64, [1, 2, 5])
    assert all(s > 0 for s in cost.seconds)
    path = builtin_drafter("sdar-tiny", "spot", 32, "static")
    spot = load_drafter("spot", path, 4, elsewhere)
    auto = AutoBudget(spot, acceptance_curve("spot", path), cost)
    config = DecodingConfig(gen_length=32, block_length=32, temperature=0.8)
    expected = [r.tokens.tolist() for r in generate(target, requests, config)]
    assert [r.tokens.tolist() for r in generate(elsewhere, requests, config, drafter=auto)] == (
        expected
    )
