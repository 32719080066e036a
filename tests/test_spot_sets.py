"""SPOT-Sets on the toy target with the threshold rule: exact output, fewer forwards."""

import pytest
import torch

from spot.config import DecodingConfig
from spot.decode import generate
from spot.drafters.spot_sets import SetModel, SetModelConfig, SpotSetsDrafter, likely_sets
from spot.drafters.training import adapt_set_model, build_samples, train_set_model
from spot.drafters.trajectory import TrajectoryRecorder
from tests.test_spot_drafter import requests
from tests.toy import ToyTarget

SMALL = SetModelConfig(d_model=32, num_layers=1, num_heads=4, ff_size=64, target_hidden_size=8)


def test_likely_sets_in_order_of_probability():
    logits = torch.tensor([3.0, -0.2, 0.1, -4.0, 0.0])
    masked = torch.tensor([True, True, True, True, False])
    sets = likely_sets(logits, masked, count=4, max_flips=8)
    assert [s for _, s in sets] == [(0, 2), (0,), (0, 1, 2), (0, 1)]  # flip costs 0.1, 0.2, 0.3
    logps = [lp for lp, _ in sets]
    assert logps == sorted(logps, reverse=True)
    ls = torch.nn.functional.logsigmoid
    expected = float(ls(torch.tensor(3.0)) + ls(torch.tensor(0.2)) + ls(torch.tensor(0.1)))
    expected += float(ls(torch.tensor(4.0)))
    assert abs(logps[0] - expected) < 1e-6  # float32 reference terms


def test_no_empty_set_is_proposed():
    logits = torch.tensor([-3.0, -2.0])
    sets = likely_sets(logits, torch.tensor([True, True]), count=3, max_flips=8)
    assert [s for _, s in sets] == [(1,), (0,), (0, 1)]


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_spot_sets_is_exact_and_saves_forwards_after_training(temperature):
    target = ToyTarget(seed=3, sharpness=4.0)
    config = DecodingConfig(
        gen_length=32,
        block_length=8,
        rule="threshold",
        threshold=0.7,
        temperature=temperature,
        seed=1,
    )
    reqs = requests(24, seed=5)
    rec = TrajectoryRecorder([r.key for r in reqs], 8, target.mask_id, record_hidden=True)
    generate(target, reqs, config, trace=rec)
    meta = {
        "steps_per_block": 8,
        "temperature": temperature,
        "seed": 1,
        "confidence": target.confidence,
        "vocab_size": target.vocab_size,
    }
    traj = rec.result(meta)
    assert traj.hidden is not None and traj.hidden.shape[:2] == traj.masked.shape
    train, held = traj.split(0.25)
    model, metrics = train_set_model(
        build_samples(train, SMALL),
        build_samples(held, SMALL),
        train.hidden,
        held.hidden,
        target.embed,
        SMALL,
        epochs=4,
    )
    assert 0.0 <= metrics["heldout_exact_set_accuracy"] <= 1.0
    test = requests(6, seed=9, offset=100)
    plain = generate(target, test, config)
    drafted = generate(target, test, config, drafter=SpotSetsDrafter(model, target.embed, 6))
    assert [r.tokens.tolist() for r in drafted] == [r.tokens.tolist() for r in plain]
    assert sum(r.stats.nfe for r in drafted) < sum(r.stats.nfe for r in plain)


@pytest.mark.parametrize("temperature,refresh", [(0.0, None), (0.8, None), (0.0, 1), (0.8, 2)])
def test_untrained_spot_sets_changes_nothing(temperature, refresh):
    target = ToyTarget(seed=1, sharpness=2.0)
    config = DecodingConfig(
        gen_length=16, block_length=8, rule="threshold", threshold=0.5, temperature=temperature
    )
    reqs = requests(3, seed=2)
    drafter = SpotSetsDrafter(SetModel(SMALL), target.embed, budget=5, refresh=refresh)
    plain = generate(target, reqs, config)
    drafted = generate(target, reqs, config, drafter=drafter)
    assert [r.tokens.tolist() for r in drafted] == [r.tokens.tolist() for r in plain]


def test_spot_sets_rejects_the_static_rule():
    target = ToyTarget()
    drafter = SpotSetsDrafter(SetModel(SMALL), target.embed, budget=2)
    with pytest.raises(ValueError, match="threshold"):
        generate(target, requests(1, seed=0), DecodingConfig(16, 8), drafter=drafter)


class WideToy(ToyTarget):
    hidden_size = 12


def _threshold_trajectories(target, reqs, config):
    rec = TrajectoryRecorder([r.key for r in reqs], 8, target.mask_id, record_hidden=True)
    generate(target, reqs, config, trace=rec)
    meta = {
        "steps_per_block": 8,
        "temperature": config.temperature,
        "seed": config.seed,
        "confidence": target.confidence,
        "vocab_size": target.vocab_size,
    }
    return rec.result(meta)


def test_a_set_model_adapts_to_another_width_by_training_its_projections_alone():
    config = DecodingConfig(gen_length=32, block_length=8, rule="threshold", threshold=0.7)
    wide = WideToy(seed=3, sharpness=4.0)
    source_traj = _threshold_trajectories(wide, requests(16, seed=5), config)
    wide_config = SetModelConfig(**{**SMALL.to_dict(), "target_hidden_size": 12})
    source, _ = train_set_model(
        *(build_samples(t, wide_config) for t in source_traj.split(0.25)),
        *(t.hidden for t in source_traj.split(0.25)),
        wide.embed,
        wide_config,
        epochs=2,
        batch_size=32,
    )
    target = ToyTarget(seed=3, sharpness=4.0)
    adapted = adapt_set_model(source, target.hidden_size)
    assert adapted.config.target_hidden_size == 8
    trainable = {n for n, p in adapted.named_parameters() if p.requires_grad}
    assert trainable == {
        f"{m}.{p}" for m in ("hidden_proj", "token_proj") for p in ("weight", "bias")
    }
    shared = {
        k: v.clone()
        for k, v in adapted.state_dict().items()
        if k.split(".")[0] not in ("hidden_proj", "token_proj")
    }
    assert all(torch.equal(v, source.state_dict()[k]) for k, v in shared.items())

    traj = _threshold_trajectories(target, requests(24, seed=6), config)
    train, held = traj.split(0.25)
    model, _ = train_set_model(
        build_samples(train, adapted.config),
        build_samples(held, adapted.config),
        train.hidden,
        held.hidden,
        target.embed,
        adapted.config,
        epochs=3,
        batch_size=32,
        model=adapted,
    )
    assert model is adapted
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in shared.items())
    assert model.hidden_proj.weight.abs().sum() > 0 and model.token_proj.weight.abs().sum() > 0
    test = requests(6, seed=9, offset=100)
    plain = generate(target, test, config)
    drafted = generate(target, test, config, drafter=SpotSetsDrafter(model, target.embed, 6))
    assert [r.tokens.tolist() for r in drafted] == [r.tokens.tolist() for r in plain]
    assert sum(r.stats.nfe for r in drafted) < sum(r.stats.nfe for r in plain)


@pytest.mark.parametrize(
    "confidences,threshold,first,second",
    [
        ([0.95, 0.5, 0.99, 0.89, 0.2], 0.9, (0, 2), (0, 2, 3)),  # 0.95, 0.99 pass; 0.89 nearly
        ([0.5, 0.3, 0.7, 0.2, 0.9], 0.9, (2,), (0, 2)),  # none passes: the most confident alone
        ([0.95, 0.5, 0.99, 0.89, 0.2], 1.0, (2,), (0,)),  # a bar of 1 passes nothing
    ],
)
def test_untrained_set_model_proposes_the_stale_thresholded_set_first(
    confidences, threshold, first, second
):
    from spot.drafters.order_model import order_features

    k = SMALL.top_k
    conf = torch.tensor([confidences], dtype=torch.float64)
    top = torch.full((1, 5, k), float("-inf"))
    top[..., 0] = conf.log().float()
    masked = torch.tensor([[True, True, True, True, False]])
    feats = order_features(
        top, masked, torch.zeros_like(masked), conf, torch.zeros(1), torch.ones(1), SMALL
    )
    model = SetModel(SMALL).eval()
    with torch.no_grad():
        logits = model(feats, torch.randn(1, 5, 8), torch.randn(1, 5, 8), masked, threshold)[0]
    sets = likely_sets(logits, masked[0], count=2, max_flips=8)
    assert [s for _, s in sets] == [first, second]
