"""SPOT on the toy target: record trajectories, train the order model briefly, draft trees.

Whatever the order model's quality, the output must equal draft-free decoding; a trained model
must also save forwards.
"""

import dataclasses
import itertools
import math

import pytest
import torch

from spot.config import DecodingConfig
from spot.decode import Request, generate
from spot.drafters.order_model import Encoder, OrderModel, OrderModelConfig
from spot.drafters.spiffy import DraftGraph, SpiffyDrafter, calibrate
from spot.drafters.spot import SpotDrafter
from spot.drafters.training import (
    build_samples,
    commit_order_log_likelihood,
    root_samples,
    train_order_model,
)
from spot.drafters.trajectory import Trajectories, TrajectoryRecorder
from spot.drafting import DraftInput, StepNoise
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
        "rule": config.rule.value,
        "threshold": config.threshold,
        "temperature": config.temperature,
        "seed": config.seed,
        "confidence": target.confidence,
        "vocab_size": target.vocab_size,
    }
    return rec.result(meta)


@pytest.mark.parametrize(
    "temperature,refresh,tokens_per_step",
    [
        (0.0, 1, 1),
        (0.8, 1, 1),
        (0.0, 3, 1),
        (0.8, None, 1),
        (0.0, None, 2),
        (0.8, 3, 2),
        (0.0, 1, 2),
    ],
)
def test_untrained_order_model_changes_nothing(temperature, refresh, tokens_per_step):
    target = ToyTarget(seed=3, sharpness=2.0)
    config = DecodingConfig(
        gen_length=24,
        block_length=8,
        temperature=temperature,
        seed=2,
        tokens_per_step=tokens_per_step,
    )
    reqs = requests(4, seed=1)
    drafter = SpotDrafter(OrderModel(SMALL), budget=6, refresh=refresh)
    plain = generate(target, reqs, config)
    drafted = generate(target, reqs, config, drafter=drafter)
    assert [r.tokens.tolist() for r in drafted] == [r.tokens.tolist() for r in plain]
    assert all(d.stats.nfe <= p.stats.nfe for d, p in zip(drafted, plain))
    assert all(d.stats.tree_nodes <= d.stats.nfe * 7 for d in drafted)


@pytest.mark.parametrize("samples", [build_samples, root_samples])
def test_trajectories_roundtrip_and_trained_model_saves_forwards(tmp_path, samples):
    target = ToyTarget(seed=3, sharpness=4.0)
    config = DecodingConfig(gen_length=32, block_length=8)
    traj = record(target, requests(24, seed=5), config)
    assert traj.committed.sum(dim=1).eq(1).all()  # 1 token per step
    assert (traj.committed <= traj.masked).all()
    traj.save(tmp_path / "t.pt")
    again = Trajectories.load(tmp_path / "t.pt")
    assert torch.equal(again.top_ids, traj.top_ids) and again.meta == traj.meta
    train, held = traj.split(0.25)
    model, metrics = train_order_model(samples(train, SMALL), samples(held, SMALL), SMALL, epochs=3)
    assert metrics["heldout_next_commit_accuracy"] > 0.4  # uniform guessing: ~0.37
    reqs = requests(6, seed=9, offset=100)
    plain = generate(target, reqs, config)
    drafted = generate(target, reqs, config, drafter=SpotDrafter(model, budget=8))
    assert [r.tokens.tolist() for r in drafted] == [r.tokens.tolist() for r in plain]
    nfe_plain = sum(r.stats.nfe for r in plain)
    nfe_drafted = sum(r.stats.nfe for r in drafted)
    assert nfe_drafted < 0.7 * nfe_plain, (nfe_drafted, nfe_plain)


def test_samples_at_positive_temperature_need_the_noise_their_recording_drew():
    """A T>0 recording's features are recomputed from the coupled noise: trajectories drawn
    with another generator would train on draws the target never made, so they are refused."""
    target = ToyTarget(seed=3, sharpness=4.0)
    config = DecodingConfig(gen_length=16, block_length=8, temperature=0.8, seed=2)
    traj = record(target, requests(4, seed=5), config)
    assert traj.meta["noise"] == "splitmix64-stream"
    assert build_samples(traj, SMALL).features.shape[0] > 0
    older = dataclasses.replace(traj, meta=traj.meta | {"noise": "mt19937"})
    with pytest.raises(ValueError, match="record them again"):
        build_samples(older, SMALL)
    at_zero = record(target, requests(4, seed=5), DecodingConfig(gen_length=16, block_length=8))
    at_zero.meta.pop("noise")
    assert build_samples(at_zero, SMALL).features.shape[0] > 0  # T=0 reads no noise


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_spiffy_graph_calibrates_and_changes_nothing(tmp_path, temperature):
    target = ToyTarget(seed=3, sharpness=4.0)
    config = DecodingConfig(gen_length=32, block_length=8, temperature=temperature, seed=4)
    graph = calibrate(record(target, requests(16, seed=5), config), budget=8, max_depth=4)
    assert len(graph.paths) == 8
    assert all(p[:-1] in graph.paths or len(p) == 1 for p in graph.paths)  # prefix-closed
    assert list(graph.counts)[0] == max(graph.counts)
    graph.save(tmp_path / "g.json")
    assert DraftGraph.load(tmp_path / "g.json").paths == graph.paths
    reqs = requests(6, seed=9, offset=100)
    plain = generate(target, reqs, config)
    for keep in (None, 3):
        drafted = generate(target, reqs, config, drafter=SpiffyDrafter(graph, keep=keep))
        assert [r.tokens.tolist() for r in drafted] == [r.tokens.tolist() for r in plain]
        assert sum(r.stats.nfe for r in drafted) < sum(r.stats.nfe for r in plain)
        limit = 1 + (keep or 8)
        assert all(r.stats.tree_nodes <= limit * r.stats.nfe for r in drafted)


def _one_tree(drafter, inp):
    """The drafter's tree for one hand-built input, with noise of its own."""
    noise = StepNoise(inp.config.seed, inp.config.temperature)
    return drafter.propose([inp], noise, 1)[0]


def _hand_built_input(stale_tops, rest=-5.0):
    """A 4-position block whose stale forward saw everything masked and whose root has since
    committed position 3; stale_tops: the stale logits of tokens 3, 4, 5, 6 at positions
    0-3 (every other token at `rest`)."""
    from spot.tree import Layout, State

    layout = Layout.for_prompt(4, 4, 4, 4, False, 11, (10,))
    logits = torch.full((4, 12), rest)
    for position, value in enumerate(stale_tops):
        logits[position, 3 + position] = value
    stale = State(4, torch.tensor([11, 11, 11, 11]), 0, 0)
    root = State(4, torch.tensor([11, 11, 11, 6]), 1, 1)
    return DraftInput(layout, root, stale, logits, None, 0, DecodingConfig(4, 4), "untempered")


def test_spiffy_prefers_the_graph_paths_of_a_hand_built_case():
    # root with 3 masked positions whose stale confidences rank 2 > 0 > 1
    inp = _hand_built_input([2.0, 1.0, 3.0, 4.0])
    graph = DraftGraph((((0, 0),), ((1, 0),), ((0, 0), (0, 0))), (5, 3, 2), {})
    tree = _one_tree(SpiffyDrafter(graph), inp)
    assert [n.block(4).tolist() for n in tree.nodes] == [
        [11, 11, 11, 6],
        [11, 11, 5, 6],  # rank 0: position 2, its top token
        [3, 11, 11, 6],  # rank 1: position 0
        [3, 11, 5, 6],  # then rank 0 of what is left: position 0
    ]
    assert tree.parent == (-1, 0, 0, 1)


class _FixedOrder(torch.nn.Module):
    """An order model that scores every position the same way whatever the features."""

    def __init__(self, scores):
        super().__init__()
        self.config = SMALL
        self.scores = torch.tensor(scores)
        self.calls = 0

    def forward(self, features, masked):
        self.calls += 1
        return self.scores.expand_as(masked).masked_fill(~masked, float("-inf"))


def test_spot_ranks_a_whole_tree_from_one_evaluation_of_the_root():
    # root: positions 0-2 masked; scores rank 2 > 0 > 1; stale tokens 3, 4, 5 near-certain
    inp = _hand_built_input([9.0, 9.0, 9.0, 9.0], rest=-9.0)
    model = _FixedOrder([1.0, 0.0, 2.0, 5.0])
    tree = _one_tree(SpotDrafter(model, budget=4, branching=2), inp)
    # log-probabilities renormalised over what is left: position 2 first (-0.41), then 0
    # (-0.31 more, as 1 - log(e + 1)), then 1 (certain, 0 more): -0.72 in all, ahead of the
    # root's second choice, position 0 (-1.41)
    assert [n.block(4).tolist() for n in tree.nodes] == [
        [11, 11, 11, 6],
        [11, 11, 5, 6],
        [3, 11, 5, 6],
        [3, 4, 5, 6],
        [3, 11, 11, 6],
    ]
    assert tree.parent == (-1, 0, 1, 2, 0)
    assert model.calls == 1


def test_a_state_two_orders_reach_is_drafted_once_and_the_budget_drafts_another():
    # scores rank 2 > 0 > 1 with 0 close behind: "2 then 0" and "0 then 2" reach one state
    inp = _hand_built_input([9.0, 9.0, 9.0, 9.0], rest=-9.0)
    model = _FixedOrder([1.9, 0.0, 2.0, 5.0])
    tree = _one_tree(SpotDrafter(model, budget=5, branching=3), inp)
    blocks = [n.block(4).tolist() for n in tree.nodes]
    assert blocks == [
        [11, 11, 11, 6],
        [11, 11, 5, 6],  # position 2
        [3, 11, 11, 6],  # position 0
        [3, 11, 5, 6],  # 2 then 0
        [3, 4, 5, 6],  # 2, 0 then 1
        [11, 4, 11, 6],  # 0 then 2, next in line, is the state above: position 1 instead
    ]
    assert tree.parent == (-1, 0, 0, 1, 3, 0)


def test_spiffy_drafts_a_repeated_state_once_and_fills_its_budget_past_it():
    # ranks 2 > 0 > 1; (0,0),(0,0) and (1,0),(0,0) both commit positions 2 and 0
    inp = _hand_built_input([2.0, 1.0, 3.0, 4.0])
    paths = (((0, 0),), ((1, 0),), ((0, 0), (0, 0)), ((1, 0), (0, 0)), ((2, 0),))
    graph = DraftGraph(paths, (9, 6, 5, 4, 3), {})
    tree = _one_tree(SpiffyDrafter(graph, budget=4), inp)
    assert [n.block(4).tolist() for n in tree.nodes] == [
        [11, 11, 11, 6],
        [11, 11, 5, 6],  # (0, 0): position 2
        [3, 11, 11, 6],  # (1, 0): position 0
        [3, 11, 5, 6],  # (0, 0), (0, 0); (1, 0), (0, 0) is the same state
        [11, 4, 11, 6],  # so the budget's fourth node is the next path's, (2, 0)
    ]
    assert tree.parent == (-1, 0, 0, 1, 0)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_no_tree_holds_a_state_twice(temperature):
    """Seeded: trees of both drafters on a toy target's real decoding, at every step."""
    target = ToyTarget(seed=5, sharpness=1.0)
    config = DecodingConfig(gen_length=16, block_length=8, temperature=temperature, seed=2)
    plain = generate(target, requests(3, seed=4), config)
    formulas = [(i, 0) for i in range(3)]  # any of the 3 most confident, 1 to 3 deep
    paths = [p for d in (1, 2, 3) for p in itertools.product(formulas, repeat=d)]
    graph = DraftGraph(tuple(paths), tuple(100 - 10 * len(p) for p in paths), {"rule": "static"})
    for drafter in (SpotDrafter(OrderModel(SMALL), budget=12), SpiffyDrafter(graph, budget=12)):
        trees: list = []
        drafted = generate(
            target,
            requests(3, seed=4),
            config,
            drafter=drafter,
            on_walk=lambda i, tree, path, trees=trees: trees.append(tree),
        )
        assert [r.tokens.tolist() for r in drafted] == [r.tokens.tolist() for r in plain]
        for tree in trees:
            keys = [n.key for n in tree.nodes]
            assert len(keys) == len(set(keys))


def test_drafted_tokens_at_zero_temperature_are_the_commit_rules_never_the_mask():
    # the mask token (11) tops position 0's stale logits: the rule takes the runner-up, token 3
    inp = _hand_built_input([9.0, 9.0, 9.0, 9.0], rest=-9.0)
    inp.stale_logits[0, 11] = 12.0
    tokens, _ = StepNoise(inp.config.seed, 0.0).draw(inp, inp.root.step)
    assert tokens.tolist() == [3, 4, 5, 6]
    tree = _one_tree(SpotDrafter(_FixedOrder([2.0, 1.0, 0.0, 5.0]), budget=3, branching=1), inp)
    assert [n.block(4).tolist() for n in tree.nodes] == [
        [11, 11, 11, 6],
        [3, 11, 11, 6],
        [3, 4, 11, 6],
        [3, 4, 5, 6],
    ]


def _threshold_input(root_block, stale_logits, threshold):
    from spot.tree import Layout, State

    layout = Layout.for_prompt(4, 4, 4, 4, False, 11, (10,))
    stale = State(4, torch.tensor([11, 11, 11, 11]), 0, 0)
    root = State(4, torch.tensor(root_block), 1, 1)
    config = DecodingConfig(4, 4, rule="threshold", threshold=threshold)
    return DraftInput(layout, root, stale, stale_logits, None, 0, config, "untempered")


def test_threshold_spiffy_drafts_the_stale_thresholded_set_and_its_resizings():
    # stale confidences of the argmax tokens 3, 4, 5, 6: ~0.9995, ~0.198, ~0.996, ~0.402
    logits = torch.zeros(4, 12)
    logits[0, 3], logits[1, 4], logits[2, 5], logits[3, 6] = 10.0, 1.0, 8.0, 2.0
    inp = _threshold_input([11, 11, 11, 11], logits, threshold=0.9)
    paths = (((0, 0),), ((1, 0),), ((-1, 0),), ((0, 0), (0, 0)), ((-2, 0),))
    graph = DraftGraph(paths, (9, 5, 4, 3, 1), {"rule": "threshold"})
    tree = _one_tree(SpiffyDrafter(graph), inp)
    assert [n.block(4).tolist() for n in tree.nodes] == [
        [11, 11, 11, 11],
        [3, 11, 5, 11],  # the thresholded set {0, 2}
        [3, 11, 5, 6],  # one more: the next most confident, position 3
        [3, 11, 11, 11],  # one fewer: position 0 alone
        [3, 11, 5, 6],  # then nothing passes 0.9: the most confident, position 3
    ]  # (-2, 0) would commit nothing: not a node
    assert tree.parent == (-1, 0, 0, 0, 1)
    with pytest.raises(ValueError, match="calibrated for the static rule"):
        _one_tree(SpiffyDrafter(DraftGraph(paths[:1], (1,), {"rule": "static"})), inp)


def test_threshold_spiffy_calibration_of_a_hand_written_trajectory():
    # one block of 4: the target commits {0}, then {1, 2}, then {3}
    probs = torch.zeros(3, 4, 2)
    ids = torch.zeros(3, 4, 2, dtype=torch.int32)
    probs[0, :, 0] = torch.tensor([0.99, 0.95, 0.5, 0.3])
    ids[0, :, 0] = torch.tensor([3, 4, 5, 6])
    probs[1, :, 0] = torch.tensor([0.0, 0.6, 0.7, 0.97])
    ids[1, :, 0] = torch.tensor([0, 4, 5, 6])
    masked = torch.tensor([[1, 1, 1, 1], [0, 1, 1, 1], [0, 0, 0, 1]], dtype=torch.bool)
    committed = torch.tensor([[1, 0, 0, 0], [0, 1, 1, 0], [0, 0, 0, 1]], dtype=torch.bool)
    tokens = torch.tensor([[3, -1, -1, -1], [-1, 4, 5, -1], [-1, -1, -1, 6]], dtype=torch.int32)
    traj = Trajectories(
        probs.log(),
        ids,
        masked,
        committed,
        tokens,
        segment=torch.zeros(3, dtype=torch.int32),
        block_step=torch.arange(3, dtype=torch.int32),
        step=torch.arange(3),
        key=torch.zeros(3, dtype=torch.int64),
        meta={"rule": "threshold", "threshold": 0.9},
    )
    graph = calibrate(traj, budget=3)
    # from record 0: {1, 2} is the stale thresholded set {1} grown by one, then {3} is the
    # thresholded set (nothing passes: the most confident); from record 1: {3} passes
    assert graph.paths == (((0, 0),), ((1, 0),), ((1, 0), (0, 0)))
    assert graph.counts == (1, 1, 1)
    assert graph.meta["rule"] == "threshold"


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_threshold_spiffy_calibrates_and_changes_nothing(temperature):
    target = ToyTarget(seed=3, sharpness=4.0)
    config = DecodingConfig(
        gen_length=32, block_length=8, rule="threshold", threshold=0.7, temperature=temperature
    )
    graph = calibrate(record(target, requests(16, seed=5), config), budget=8, max_depth=4)
    assert graph.paths and graph.meta["rule"] == "threshold"
    reqs = requests(6, seed=9, offset=100)
    plain = generate(target, reqs, config)
    drafted = generate(target, reqs, config, drafter=SpiffyDrafter(graph))
    assert [r.tokens.tolist() for r in drafted] == [r.tokens.tolist() for r in plain]
    assert sum(r.stats.nfe for r in drafted) < sum(r.stats.nfe for r in plain)


@pytest.mark.parametrize("refresh", [1, 4, None])
def test_trees_fill_the_budget_whatever_the_refresh(refresh):
    # a round whose new nodes all reuse an earlier evaluation must not end the growth
    target = ToyTarget(seed=3, sharpness=2.0)
    config = DecodingConfig(gen_length=16, block_length=16)
    sizes = []
    drafter = SpotDrafter(OrderModel(SMALL), budget=6, per_round=2, refresh=refresh)
    generate(
        target,
        requests(2, seed=1),
        config,
        drafter=drafter,
        on_walk=lambda i, tree, path: sizes.append(len(tree.nodes)),
    )
    assert max(sizes) == 7  # a 16-position block has room for all 6 nodes


@pytest.mark.parametrize("samples", [20, 40, 3])
def test_fit_schedules_any_step_count_and_names_too_few(samples):
    from spot.drafters.training import _fit

    model = torch.nn.Linear(2, 1)
    x = torch.randn(samples, 2)

    def loss(idx):
        return model(x[idx]).pow(2).mean()

    g = torch.Generator().manual_seed(0)
    if samples < 4:
        with pytest.raises(ValueError, match="record trajectories on more prompts"):
            _fit(model, samples, loss, 1, 2, 1e-3, g, None)
    else:
        _fit(model, samples, loss, 2, 2, 1e-3, g, None)  # 20 steps broke the schedule


def test_fit_keeps_the_epoch_that_validates_best():
    from spot.drafters.training import _fit

    model = torch.nn.Linear(2, 1)
    x = torch.randn(16, 2)
    states, scripted = [], iter([0.2, 0.9, 0.5, 0.9])  # before training, then per epoch

    def validate():
        states.append(model.weight.detach().clone())
        return next(scripted)

    g = torch.Generator().manual_seed(0)
    scores = _fit(model, 16, lambda idx: model(x[idx]).sum(), 3, 4, 1e-2, g, None, validate)
    assert scores == [0.2, 0.9, 0.5, 0.9]
    assert torch.equal(model.weight, states[3])  # ties go to the later epoch
    assert not torch.equal(states[1], states[3])


def test_recorded_trajectories_keep_the_commit_order_among_near_certain_positions():
    # three positions all above 1 - 1e-7, the target commits the most confident (position 2);
    # probabilities in float32 would all read 1.0 and rank position 0 first
    from spot.drafters.order_model import noisy_confidence
    from spot.tree import State

    logits = torch.zeros(3, 5)
    logits[:, 1] = torch.tensor([17.0, 19.0, 21.0])  # 1 - p = 1.7e-7, 2.2e-8, 3.0e-9
    recorder = TrajectoryRecorder([0], block_length=3, mask_id=4, top_k=2)
    state = State(0, torch.full((3,), 4), 0, 0)
    successor = State(0, torch.tensor([4, 4, 1]), 1, 1)
    recorder(0, state, logits, successor, None)
    traj = recorder.result({})
    assert torch.softmax(logits, -1)[:, 1].float().unique().numel() == 1  # float32 ties
    conf = noisy_confidence(traj.top_logprobs[0], traj.top_ids[0], None, 0.0, "tempered")
    assert conf.argmax().item() == 2 == traj.committed[0].nonzero().item()
    assert conf[2] > conf[1] > conf[0]


def test_spiffy_budget_takes_the_most_frequent_paths_and_predicts_its_acceptance():
    paths = (((0, 0),), ((1, 0),), ((0, 0), (0, 0)), ((0, 0), (0, 0), (0, 0)))
    graph = DraftGraph(paths, (80, 10, 60, 30), {"records": 100, "rule": "static"})
    drafter = SpiffyDrafter(graph, budget=2)
    assert graph.most_frequent(drafter.budget).paths == (((0, 0),), ((0, 0), (0, 0)))
    assert graph.most_frequent(3).paths == (((0, 0),), ((0, 0), (0, 0)), ((0, 0), (0, 0), (0, 0)))
    assert graph.paths_by_count[:3] == (
        ((0, 0),),
        ((0, 0), (0, 0)),
        ((0, 0), (0, 0), (0, 0)),
    )
    assert drafter.ranked == (((0, 0),), ((0, 0), (0, 0)), ((0, 0), (0, 0), (0, 0)), ((1, 0),))
    assert drafter.budget == 2 and SpiffyDrafter(graph, budget=9).budget == 4
    curve = graph.acceptance_curve([0, 1, 2, 3, 4])
    assert curve.steps_per_forward == (1.0, 1.8, 2.4, 2.7, 2.8)


def test_encoder_keeps_torchs_transformer_encoder_keys_and_outputs():
    """Checkpoints saved from torch's pre-norm `nn.TransformerEncoder` load into the drafters'
    own encoder and compute the same function."""
    encoder = Encoder(SMALL)
    layer = torch.nn.TransformerEncoderLayer(
        SMALL.d_model,
        SMALL.num_heads,
        SMALL.ff_size,
        dropout=0.0,
        batch_first=True,
        norm_first=True,
    )
    reference = torch.nn.TransformerEncoder(layer, SMALL.num_layers, enable_nested_tensor=False)
    g = torch.Generator().manual_seed(0)
    for p in reference.parameters():
        torch.nn.init.normal_(p, std=0.3, generator=g)
    encoder.load_state_dict(reference.state_dict())  # strict: the same keys and shapes
    x = torch.randn(3, 16, SMALL.d_model, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(encoder(x), reference.eval()(x), rtol=1e-5, atol=1e-5)


def test_inference_copies_of_the_weights_follow_every_change():
    """Without autograd the drafters multiply by cached [in, out] copies of their weights: the
    same function as the autograd path, after an optimizer step and after load_state_dict."""
    encoder, other = Encoder(SMALL), Encoder(SMALL)
    x = torch.randn(3, 16, SMALL.d_model, generator=torch.Generator().manual_seed(1))

    def both_paths():
        with torch.no_grad():
            cached = encoder(x)
        torch.testing.assert_close(cached, encoder(x).detach(), rtol=1e-5, atol=1e-5)
        return cached

    before = both_paths()
    optimizer = torch.optim.SGD(encoder.parameters(), lr=0.5)
    encoder(x).square().mean().backward()
    optimizer.step()
    stepped = both_paths()
    assert (stepped - before).abs().max() > 1e-3
    encoder.load_state_dict(other.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(both_paths(), other(x), rtol=1e-5, atol=1e-5)


def test_commit_order_log_likelihood_of_hand_written_orders():
    """Plackett-Luce over the positions still masked, a multi-position step taking any of
    its positions; with one step, the next commit's log-likelihood."""
    inf = float("inf")
    logits = torch.tensor([[0.0, 1.0, 2.0, -inf], [0.0, 1.0, 2.0, -inf]], requires_grad=True)
    masked = torch.tensor([[True, True, True, False]] * 2)
    following = torch.zeros(2, 3, 4, dtype=torch.bool)
    following[0, 0, 2] = following[0, 1, 0] = True  # 2 then 0, then the block ended
    following[1, 0, 0] = following[1, 0, 1] = True  # 0 and 1 in one step, then 2
    following[1, 1, 2] = True
    e = math.e
    ll = commit_order_log_likelihood(logits, masked, following)
    expected = [
        math.log(e**2 / (1 + e + e**2)) + math.log(1 / (1 + e)),
        math.log((1 + e) / (1 + e + e**2)),  # then 2 is the only position left: log 1
    ]
    torch.testing.assert_close(ll, torch.tensor(expected))
    ll.sum().backward()
    assert torch.isfinite(logits.grad).all()
    first = commit_order_log_likelihood(logits, masked, following[:, :1])
    torch.testing.assert_close(first[0], torch.log_softmax(logits[0], -1)[2])
