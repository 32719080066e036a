"""Learning drafters from the rows a job decodes, on the tiny real bundled targets.

The replay counts exactly the forwards the decoder takes (every request, bundled Spiffy and
SPOT, small and large budgets); the learner calibrates Spiffy first, trains SPOT in rounds
warm-started from the last one, keeps held-out and validation rows out of training, writes
drafter files the registry loads, stops when the next round will not pay, and what it makes
never changes a token."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from pipeline.drafter_data import encode, load_model_and_tokenizer
from spot.builtin import builtin_drafter
from spot.config import DecodingConfig
from spot.decode import generate
from spot.drafters.files import read_header
from spot.drafters.learning import DrafterLearner, LearnerConfig, slice_of
from spot.drafters.order_model import stale_top
from spot.drafters.recipes import record_trajectories, recording_meta
from spot.drafters.registry import acceptance_curve, load_drafter, load_order_model
from spot.drafters.replay import ReplayTarget, replay, stale_logits
from spot.drafters.spot import SpotDrafter
from spot.drafters.trajectory import TrajectoryRecorder

spec = importlib.util.spec_from_file_location(
    "offcorpus_prompts", Path(__file__).parents[1] / "bench" / "offcorpus_prompts.py"
)
prompts = importlib.util.module_from_spec(spec)
spec.loader.exec_module(prompts)

CONFIG = DecodingConfig(gen_length=32, block_length=16)


@pytest.fixture(scope="module")
def nano():
    tokenizer, target = load_model_and_tokenizer("builtin:sdar-nano")
    return target, encode(tokenizer, prompts.offcorpus_prompts(48))


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_replay_counts_the_decoders_own_forwards(nano, temperature):
    """Exactly at T=0. At T>0 the commit rule's confidences are tempered over the whole
    vocabulary, of which a recording keeps the top-k: the replay then differs now and then
    by a forward."""
    target, requests = nano
    requests = requests[:8]
    config = DecodingConfig(gen_length=32, block_length=16, temperature=temperature, seed=5)
    traj = record_trajectories(target, requests, config, batch_size=4)
    cases = (("spiffy", 2), ("spiffy", 16), ("spot", 3), ("spot", 16))
    for kind, budget in cases if temperature == 0.0 else cases[::3]:
        path = builtin_drafter("sdar-nano", kind, 16, "static")
        drafter = load_drafter(kind, path, budget, target)
        results = generate(target, requests, config, drafter=drafter, max_active=4)
        replayed = replay(drafter, traj, ReplayTarget.of(target))
        decoded = {r.key: x.stats.nfe for r, x in zip(requests, results)}
        if temperature == 0.0:
            assert replayed.forwards == decoded
        else:
            same = sum(replayed.forwards[k] == n for k, n in decoded.items())
            assert same >= 6  # of 8
            assert sum(replayed.forwards.values()) == pytest.approx(sum(decoded.values()), 0.05)
        assert sum(replayed.steps.values()) == traj.segment.numel()
        assert replayed.stops.total() == sum(replayed.forwards.values())
        assert replayed.stops["end"] + replayed.stops["no draft"] >= len(requests)


def test_a_drafter_reading_hidden_states_replays_from_a_recording_that_kept_them(nano):
    """SPOT-Sets reads the stale forward's hidden states: replayed on a recording that kept
    them, it counts the decoder's own forwards; on one without them it is refused."""
    target, requests = nano
    requests = requests[:6]
    config = DecodingConfig(gen_length=32, block_length=16, rule="threshold", threshold=0.9)
    path = builtin_drafter("sdar-nano", "spot-sets", 16, "threshold")
    drafter = load_drafter("spot-sets", path, 8, target)
    results = generate(target, requests, config, drafter=drafter, max_active=3)
    traj = record_trajectories(target, requests, config, batch_size=3, hidden=True)
    replayed = replay(drafter, traj, ReplayTarget.of(target))
    assert replayed.forwards == {r.key: x.stats.nfe for r, x in zip(requests, results)}
    plain = record_trajectories(target, requests[:1], config, batch_size=1)
    with pytest.raises(ValueError, match="hidden states"):
        replay(drafter, plain, ReplayTarget.of(target))


def _recorded(target, requests, config=CONFIG):
    """Trajectories of `requests` as a job hands them over: recorded by the decode loop's
    trace while it decodes (here with a drafter: recording takes no forward of its own)."""
    recorder = TrajectoryRecorder([r.key for r in requests], config.block_length, target.mask_id)
    drafter = load_drafter(
        "spiffy", builtin_drafter("sdar-nano", "spiffy", 16, "static"), 4, target
    )
    generate(target, requests, config, drafter=drafter, trace=recorder, max_active=8)
    return recorder.result(recording_meta(config, target, len(requests)))


def test_learner_rounds_files_and_stop(nano, tmp_path):
    target, requests = nano
    config = LearnerConfig(
        heldout_percent=20,
        validation_percent=20,
        spiffy_rows=8,
        spot_rows=(16, 32, 64),
        min_gain=10.0,  # any second round stops it
        epochs=2,
        batch_size=32,
        budgets=(2, 4),
        decision_budget=4,
        replay_rows=8,
    )
    learner = DrafterLearner(ReplayTarget.of(target), tmp_path, config, "builtin:sdar-nano")
    assert learner.due() is None
    learner.add(_recorded(target, requests[:8]))
    assert learner.due() == "spiffy"
    spiffy = learner.learn()
    assert (spiffy.kind, spiffy.number, spiffy.rows) == ("spiffy", 1, 8)
    assert spiffy.before == {2: 1.0, 4: 1.0}  # draft-free
    assert spiffy.adopted and spiffy.after[4] > 1.0 and learner.current is spiffy
    assert learner.due() is None and learner.learn() is None

    learner.add(_recorded(target, requests[8:16]))
    assert learner.due() == "spot"
    first = learner.learn()
    assert [r.kind for r in learner.rounds] == ["spiffy", "spiffy", "spot"]
    assert first.kind == "spot" and first.metrics["warm_start"] is False
    recalibrated = learner.rounds[1]
    assert first.before[4] == pytest.approx(
        recalibrated.after[4] if recalibrated.adopted else recalibrated.before[4]
    )
    assert learner.due() is None and not learner.done

    learner.add(_recorded(target, requests[16:32]))
    with torch.no_grad():  # as a benchmark or a decoding process calls it
        second = learner.learn()
    assert second.kind == "spot" and second.metrics["warm_start"] is True
    assert "gain_over_last_spot" not in first.metrics
    assert second.metrics["gain_over_last_spot"] < 2 * 10.0
    assert learner.done and learner.due() is None  # the gain cannot reach min_gain

    # every round's file loads by kind and path, with its rows and held-out figures
    for r in learner.rounds:
        drafter = load_drafter(r.kind, r.path, 4, target)
        curve = acceptance_curve(r.kind, r.path)
        if r.kind == "spot":
            header = read_header(r.path)
            metrics = header["metrics"]
            assert curve.budgets == (0, 1, 2, 3, 4)
            assert curve.steps_per_forward[-1] == pytest.approx(r.after[4])
            assert 0.0 <= metrics["heldout_next_commit_accuracy"] <= 1.0
            assert header["trained_on"]["model"] == "builtin:sdar-nano"
            tree = metrics["tree_calibration"]
            assert header["tree"] == {"token_choices": tree["chosen_token_choices"]}
            assert drafter.token_choices == tree["chosen_token_choices"]
            assert model_scale(drafter) == tree["chosen_prior_scale"]
        else:
            metrics = json.loads(Path(r.path).read_text())["meta"]["learned"]["metrics"]
            assert drafter.calibrated.meta["records"] > 0
        learned = metrics["learned_from"] if r.kind == "spot" else None
        if learned is not None:
            train, val, held = (set(learned[k]) for k in ("train", "validation", "heldout"))
            assert not (train & val or train & held or val & held)
            assert len(train | val | held) == r.rows
            assert all(slice_of(k, config) == "heldout" for k in held)
        assert metrics["steps_per_forward_after"]["4"] == pytest.approx(r.after[4])

    # whatever the learner made, tokens are the target's own (T=0 and T=0.8)
    for temperature in (0.0, 0.8):
        c = DecodingConfig(gen_length=32, block_length=16, temperature=temperature, seed=1)
        plain = generate(target, requests[32:40], c)
        for r in (spiffy, second):
            drafter = load_drafter(r.kind, r.path, 4, target)
            drafted = generate(target, requests[32:40], c, drafter=drafter, max_active=4)
            assert [x.tokens.tolist() for x in drafted] == [x.tokens.tolist() for x in plain]


def model_scale(drafter) -> float:
    return float(drafter.model.prior_scale)


def test_learner_refuses_rows_of_another_decoding(nano, tmp_path):
    target, requests = nano
    learner = DrafterLearner(ReplayTarget.of(target), tmp_path)
    learner.add(_recorded(target, requests[:2]))
    other = DecodingConfig(gen_length=32, block_length=16, temperature=0.5)
    with pytest.raises(ValueError, match="share their decoding"):
        learner.add(_recorded(target, requests[2:4], other))
    with pytest.raises(ValueError, match="decision_budget"):
        LearnerConfig(budgets=(2,), decision_budget=16)


def test_slices_are_fixed_by_request_key():
    config = LearnerConfig(heldout_percent=10, validation_percent=10)
    names = [slice_of(k, config) for k in range(4000)]
    assert names == [slice_of(k, config) for k in range(4000)]
    assert 300 < names.count("heldout") < 500 and 300 < names.count("validation") < 500


def test_offcorpus_prompts_are_many_distinct_and_fixed():
    rows = prompts.offcorpus_prompts(5000)
    assert len({r["prompt"] for r in rows}) == 5000 == len({r["id"] for r in rows})
    assert len({r["kind"] for r in rows}) == len(prompts.KINDS) >= 8
    assert prompts.offcorpus_prompts(10, skip=4990) == rows[4990:]
    assert rows[:3] == [prompts.draw(prompts.SEED, i) for i in range(3)]
    from spot_common.corpus import examples

    stream = examples(0, "train")
    corpus = {next(stream).prompt for _ in range(5000)}
    assert not corpus & {r["prompt"] for r in rows}
    assert torch.tensor([len(r["prompt"]) for r in rows]).float().mean() > 40


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_runner_up_tokens_change_forwards_not_tokens(nano, temperature):
    """SPOT trees that also draft each position's runner-up tokens: the target's own tokens
    whatever they draft, and accepted paths pass where the tree branched on a token."""
    target, requests = nano
    config = DecodingConfig(gen_length=32, block_length=16, temperature=temperature, seed=2)
    model, _ = load_order_model(builtin_drafter("sdar-nano", "spot", 16, "static"))
    plain = generate(target, requests[:8], config)
    token_branches = 0

    def on_walk(index, tree, path):
        nonlocal token_branches
        for parent, child in zip(path, path[1:]):
            before = tree.nodes[parent].span

            def moved(node, before=before):  # the positions a child drafted
                return tree.nodes[node].span[: before.numel()] != before

            siblings = [c for c in tree.children(parent) if c != child]
            token_branches += any(torch.equal(moved(s), moved(child)) for s in siblings)

    drafter = SpotDrafter(model, 8, token_choices=3)
    drafted = generate(target, requests[:8], config, drafter=drafter, on_walk=on_walk)
    assert [x.tokens.tolist() for x in drafted] == [x.tokens.tolist() for x in plain]
    assert token_branches > 0


def test_stale_logits_keep_the_recorded_top_k():
    """The replay's stale logits: the recorded top-k probabilities exactly, the argmax where
    it was, and the mass left spread below the k-th token."""
    logits = torch.randn(4, 50) * 3
    logits[0, 7] = 40.0  # a near-certain position: almost no mass left
    top_logprobs, top_ids = stale_top(logits, 8)
    rebuilt = stale_logits(top_logprobs, top_ids, 50)
    logp = torch.log_softmax(rebuilt.double(), dim=-1)
    assert torch.allclose(logp.gather(-1, top_ids), top_logprobs.double(), atol=1e-6)
    assert torch.equal(rebuilt.argmax(-1), logits.argmax(-1))
    rest = logp.scatter(-1, top_ids, float("-inf")).max(-1).values
    assert bool((rest <= top_logprobs[:, -1].double() + 1e-9).all())
