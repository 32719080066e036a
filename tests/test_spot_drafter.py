"""SPOT on the toy target: record trajectories, train the order model briefly, draft trees.

Whatever the order model's quality, the output must equal draft-free decoding; a trained model
must also save forwards.
"""

import pytest
import torch

from spot.config import DecodingConfig
from spot.decode import Request, generate
from spot.drafters.order_model import OrderModel, OrderModelConfig
from spot.drafters.spot import SpotDrafter
from spot.drafters.train_order import build_samples, train_order_model
from spot.drafters.trajectory import Trajectories, TrajectoryRecorder
from spot.noise import request_key
from tests.toy import ToyTarget

SMALL = OrderModelConfig(d_model=32, num_layers=1, num_heads=4, ff_size=64)


def requests(n, seed, offset=0):
    g = torch.Generator().manual_seed(seed)
    return [
        Request(
            torch.randint(0, 10, (int(torch.randint(2, 12, (1,), generator=g)),), generator=g),
            request_key(f"p{offset + i}"),
        )
        for i in range(n)
    ]


def record(target, reqs, config):
    rec = TrajectoryRecorder([r.key for r in reqs], config.block_length, target.mask_id)
    generate(target, reqs, config, trace=rec)
    meta = {
        "steps_per_block": config.steps_per_block,
        "temperature": config.temperature,
        "seed": config.seed,
        "confidence": target.confidence,
        "vocab_size": target.vocab_size,
    }
    return rec.result(meta)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_untrained_order_model_changes_nothing(temperature):
    target = ToyTarget(seed=3, sharpness=2.0)
    config = DecodingConfig(gen_length=24, block_length=8, temperature=temperature, seed=2)
    reqs = requests(4, seed=1)
    drafter = SpotDrafter(OrderModel(SMALL), budget=6)
    plain = generate(target, reqs, config)
    drafted = generate(target, reqs, config, drafter=drafter)
    assert [r.tokens.tolist() for r in drafted] == [r.tokens.tolist() for r in plain]
    assert all(d.stats.nfe <= p.stats.nfe for d, p in zip(drafted, plain))
    assert all(d.stats.tree_nodes <= d.stats.nfe * 7 for d in drafted)


def test_trajectories_roundtrip_and_trained_model_saves_forwards(tmp_path):
    target = ToyTarget(seed=3, sharpness=4.0)
    config = DecodingConfig(gen_length=32, block_length=8)
    traj = record(target, requests(24, seed=5), config)
    assert traj.committed.sum(dim=1).eq(1).all()  # 1 token per step
    assert (traj.committed <= traj.masked).all()
    traj.save(tmp_path / "t.pt")
    again = Trajectories.load(tmp_path / "t.pt")
    assert torch.equal(again.top_ids, traj.top_ids) and again.meta == traj.meta
    train, held = traj.split(0.25)
    model, metrics = train_order_model(
        build_samples(train, SMALL), build_samples(held, SMALL), SMALL, epochs=3
    )
    assert metrics["heldout_next_commit_accuracy"] > 0.4  # uniform guessing: ~0.37
    reqs = requests(6, seed=9, offset=100)
    plain = generate(target, reqs, config)
    drafted = generate(target, reqs, config, drafter=SpotDrafter(model, budget=8))
    assert [r.tokens.tolist() for r in drafted] == [r.tokens.tolist() for r in plain]
    nfe_plain = sum(r.stats.nfe for r in plain)
    nfe_drafted = sum(r.stats.nfe for r in drafted)
    assert nfe_drafted < 0.7 * nfe_plain, (nfe_drafted, nfe_plain)
