"""Tensor parallelism on CPU with gloo: a target sharded over 2 ranks by DeepSpeed AutoTP
(its public `init_inference`) decodes exactly the tokens the unsharded target decodes, in
float32 (what a user runs: DeepSpeed shards float32 and bfloat16, never float64), at T=0 and
T>0, draft-free and with drafters (a random one whose many windows per request exercise the
mirrored contexts, and the bundled SPOT drafter), for every native family and the bundled
targets; float64 and a degree that does not divide the heads are refused. A failure every
rank meets is rank 0's to raise, the group going on; one rank's failure alone stops the group
with that rank's error.

The sharded runs happen in a child process (rank 0) that spawns rank 1, so the test process
never joins a process group."""

from __future__ import annotations

import gc
import json
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner

from pipeline.cli import main
from pipeline.job import JobError, load_job
from spot.builtin import resolve_builtin
from spot.config import DecodingConfig
from spot.decode import Request, generate
from spot.models.loading import DTYPES, load_model, load_target
from spot.models.tensor_parallel import (
    Follower,
    GroupSpec,
    ModelSpec,
    ShardedTarget,
    TensorParallelGroup,
    _Ledger,
    _Load,
    _Score,
    degree_problems,
    grain_size,
    row_parallel_names,
)
from spot.target import Window
from tests import test_models_dream_llada2 as dream_llada2
from tests import tiny_checkpoints
from tests.pipeline_fixtures import job_dict, write_prompts
from tests.random_drafter import RandomDrafter

ROOT = Path(__file__).resolve().parents[1]
FAMILIES = ("sdar", "llada", "dream", "llada2")
BUNDLED = ("sdar-nano", "sdar-tiny", "llada-tiny")
TEMPERATURES = (0.0, 0.8)


def write_checkpoint(directory: Path, family: str) -> Path:
    """A tiny float64 checkpoint of the family (4 heads, 2 key/value heads but LLaDA's 4)."""
    if family in ("dream", "llada2"):
        return dream_llada2.write_checkpoint(directory, family, seed=5)
    return tiny_checkpoints.write_checkpoint(directory, family, seed=5)


def _requests() -> list[Request]:
    generator = torch.Generator().manual_seed(0)
    lengths = (3, 6, 9)
    return [
        Request(torch.randint(0, 290, (n,), generator=generator), key=100 + i)
        for i, n in enumerate(lengths)
    ]


def _tokens(results) -> list[list[int]]:
    return [r.tokens.tolist() for r in results]


def _decoding_case(name: str, path: str):
    """(requests, block length, gen length, drafters by name) for a checkpoint: random prompts
    and a random drafter for a tiny family; held-out prompts, the random drafter and the
    shipped SPOT drafter for a bundled target."""
    if name not in BUNDLED:
        return _requests, 4, 16, {"random": lambda target: RandomDrafter(seed=1)}
    from pipeline.drafter_data import corpus_prompts, encode
    from spot.builtin import builtin_drafter
    from spot.drafters.registry import load_drafter
    from spot_common.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(Path(path))
    prompts = corpus_prompts("heldout", 4)
    spot = builtin_drafter(name, "spot", 16, "static")
    drafters = {
        "random": lambda target: RandomDrafter(seed=1),
        "spot": lambda target: load_drafter("spot", spot, 8, target),
    }
    return (lambda: encode(tokenizer, prompts)), 16, 32, drafters


def drive(checkpoints: dict[str, str], out_file: str) -> None:
    """Rank 0 of a 2-rank group (run in a child process): decode with the sharded and the
    plain float32 target of every checkpoint and write what the test compares as JSON."""
    group = TensorParallelGroup(GroupSpec(degree=2))
    report: dict[str, dict] = {}
    for name, path in checkpoints.items():
        plain = load_target(path, dtype=torch.float32)
        sharded = group.load(ModelSpec(path, None, "float32"))
        parts = [t.model.model.layers[0].self_attn for t in (sharded.local, plain)]
        record: dict = {
            "q_rows": [a.q_proj.weight.shape[0] for a in parts],
            "heads": [[a.num_heads, a.num_kv_heads] for a in parts],
            "dtype": str(parts[0].q_proj.weight.dtype),
        }
        requests, block_length, gen_length, drafters = _decoding_case(name, path)
        prompt = requests()[1].prompt
        windows = [
            Window(0, torch.full((block_length,), plain.mask_id)),
            Window(0, prompt[:block_length].clone()),
        ]
        logits = []
        for target in (plain, sharded):
            context = target.open(prompt, len(prompt) + gen_length)
            logits.append(target.score([context], windows, block_length).logits)
        record["max_logit_diff"] = float((logits[0] - logits[1]).abs().max())
        record["logit_scale"] = float(logits[0].abs().max())
        for temperature in TEMPERATURES:
            config = DecodingConfig(
                gen_length=gen_length,
                block_length=block_length,
                temperature=temperature,
                seed=3,
            )
            runs = {
                "plain": _tokens(generate(plain, requests(), config)),
                "sharded": _tokens(generate(sharded, requests(), config)),
            }
            for drafter, make in drafters.items():
                for label, target in (("plain", plain), ("sharded", sharded)):
                    runs[f"{label}+{drafter}"] = _tokens(
                        generate(target, requests(), config, make(target))
                    )
            record[str(temperature)] = runs
        report[name] = record
    group.close()
    Path(out_file).write_text(json.dumps(report))


@pytest.fixture(scope="module")
def sharded_runs(tmp_path_factory) -> dict[str, dict]:
    root = tmp_path_factory.mktemp("tp")
    checkpoints = {f: str(write_checkpoint(root / f, f)) for f in FAMILIES}
    checkpoints.update({name: str(resolve_builtin(f"builtin:{name}")) for name in BUNDLED})
    out = root / "report.json"
    code = (
        "import json, sys; from tests.test_tensor_parallel import drive; "
        "drive(json.loads(sys.argv[1]), sys.argv[2])"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, "-c", code, json.dumps(checkpoints), str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.slow  # two ranks of DeepSpeed on 2 shared cores: 1-3 minutes
@pytest.mark.parametrize("name", FAMILIES + BUNDLED)
def test_sharded_target_decodes_exactly_like_the_unsharded_one(sharded_runs, name):
    record = sharded_runs[name]
    # really sharded: half the query rows, half the heads and key/value heads per rank
    assert record["q_rows"][0] * 2 == record["q_rows"][1]
    (heads, kv_heads), full = record["heads"]
    assert [heads * 2, kv_heads * 2] == full
    assert record["dtype"] == "torch.float32"
    # float32 rounding of the split sums only; a missing all-reduce would be of the logits' size
    assert record["max_logit_diff"] < 1e-5 * record["logit_scale"]
    for temperature in map(str, TEMPERATURES):
        runs = record[temperature]
        for label, tokens in runs.items():
            assert tokens == runs["plain"], label
    # sampling changed something (a trained bundled target can be sure enough of some
    # prompts to sample its greedy tokens at T=0.8, so there it is asked of one of them)
    names = [name] if name in FAMILIES else BUNDLED
    assert any(sharded_runs[n]["0.0"]["plain"] != sharded_runs[n]["0.8"]["plain"] for n in names)


def test_deepspeed_shards_no_float64():
    """Why tensor parallelism refuses float64: DeepSpeed's public API does (on CPUs and GPUs;
    a DeepSpeed that accepts it needs its CPU all-reduce checked before SHARDED_DTYPES grows)."""
    import deepspeed

    model = torch.nn.Linear(4, 4).to(torch.float64)
    with pytest.raises(ValueError, match="torch.float64 is not supported"):
        deepspeed.init_inference(
            model,
            tensor_parallel={"tp_size": 2},
            dtype=torch.float64,
            replace_with_kernel_inject=False,
        )


class Loopback:
    """The command channel without processes: rank 0's commands, pickled as broadcast
    pickles them, applied at once to a follower holding an unsharded copy of the target."""

    def __init__(self, follower: Follower):
        self.spec = GroupSpec(degree=2)
        self.follower = follower
        self.sent: list = []
        self.ledger = _Ledger([], {}, self.spec.failure_skew)  # no other rank to hear from

    def send(self, command) -> None:
        self.sent.append(command)
        self.follower.apply(pickle.loads(pickle.dumps(command)))


@pytest.mark.parametrize("family", ["sdar", "llada"])
def test_followers_mirror_rank_0_contexts_through_its_commands(tmp_path, family):
    """The protocol that keeps ranks in step, on plain targets: every context rank 0 opens
    and keeps is rebuilt on the follower, released ones are dropped, and decoding through
    the mirrored target is unchanged."""
    path = write_checkpoint(tmp_path / family, family)
    follower = Follower(lambda model: load_target(model.path, model.family, DTYPES[model.dtype]))
    channel = Loopback(follower)
    model = ModelSpec(str(path), None, "float64")
    channel.send(_Load(0, model))
    sharded = ShardedTarget(channel, 0, load_target(path, dtype=torch.float64))
    config = DecodingConfig(gen_length=16, block_length=4, temperature=0.8, seed=3)
    plain = load_target(path, dtype=torch.float64)
    expected = _tokens(generate(plain, _requests(), config))
    assert _tokens(generate(sharded, _requests(), config, RandomDrafter(seed=1))) == expected
    assert sharded.opening_commit == plain.opening_commit  # every protocol attribute mirrored

    gc.collect()  # the finished requests' contexts are gone on rank 0 ...
    prompt = _requests()[2].prompt
    context = sharded.open(prompt, 32)
    keep = 8 if family == "sdar" else 4  # whole blocks for the block-causal target
    window = Window(0, torch.cat([prompt[:keep], torch.full((4,), plain.mask_id)]), keep)
    sharded.score([context], [window], 4)
    held = follower.contexts[0]
    assert list(held) == [context.ident]  # ... and now on the follower too
    mirror = held[context.ident]
    assert sharded.committed_length(context) == follower.targets[0].committed_length(mirror)
    assert sharded.committed_length(context) > 0
    if family == "sdar":  # the exact KV cache written by the kept tokens is the same
        for mine, theirs in zip(context.local.keys, mirror.keys):
            assert torch.equal(mine, theirs)
    assert sum(len(c.windows) for c in channel.sent[1:]) > len(channel.sent) - 1  # trees


class _FailsOnce:
    """A follower's target whose first score fails (its own out-of-memory)."""

    def __init__(self):
        self.scores = 0

    def open(self, prompt, total_length):
        return prompt

    def score(self, contexts, windows, block_length, output_hidden):
        self.scores += 1
        if self.scores == 1:
            raise MemoryError("out of memory")


def _score(after_failure: bool) -> _Score:
    window = Window(0, torch.zeros(4, dtype=torch.long))
    return _Score(
        0, [(0, torch.ones(3, dtype=torch.long), 8)], [], [0], [window], 4, False, after_failure
    )


def test_a_follower_notes_its_failure_and_goes_on_only_if_rank_0_failed_too():
    noted = []
    follower = Follower(lambda model: _FailsOnce(), lambda *note: noted.append(note))
    follower.apply(_Load(0, ModelSpec("unused")))
    follower.apply(_score(after_failure=False))
    assert noted == [(1, "MemoryError: out of memory")]
    with pytest.raises(RuntimeError, match="score 1 failed here alone: MemoryError"):
        follower.apply(_score(after_failure=False))  # rank 0 did not fail it
    follower.apply(_score(after_failure=True))  # it did: the input's failure, go on
    assert follower.scores == 2 and follower.failure is None


def test_rank_0_tells_a_failure_every_rank_met_from_one_rank_alone():
    """The watchdog's decisions, on a real pipe: a failure rank 0 met too is settled (rank 0
    raises it); one rank 0 did not meet is a rank alone, at once when rank 0 finished that
    score, after `failure_skew` while rank 0 is still in it (waiting in a collective)."""
    read, write = os.pipe()
    ledger = _Ledger([], {1: read}, skew=0.3)

    def note(score: int, error: str) -> None:
        os.write(write, (json.dumps({"score": score, "error": error}) + "\n").encode())
        ledger.read_notes()

    both = ledger.start()
    note(both, "MemoryError: on every rank")
    ledger.failed(both, "MemoryError: on every rank")  # returns: rank 1 met it too
    assert ledger.last_failed and ledger.alone() is None
    still_running = ledger.start()
    note(still_running, "MemoryError: rank 1 alone")
    assert ledger.alone() is None  # rank 0 may yet meet it
    time.sleep(0.4)
    assert ledger.alone() == (1, "MemoryError: rank 1 alone")
    ledger = _Ledger([], {1: read}, skew=60.0)  # rank 0 finishes a score rank 1 then fails
    ledger.succeeded(ledger.start())
    note(1, "RuntimeError: after the last all-reduce")
    assert ledger.alone() == (1, "RuntimeError: after the last all-reduce")


FAULTS = ROOT / "tests" / "tensor_parallel_faults"  # its sitecustomize injects the failures


def drive_failures(checkpoint: str, plan_file: str, out_file: str) -> None:
    """Rank 0 of a 2-rank group (run in a child process, failures injected by FAULTS): a
    forward that fails on both ranks, decoding again, then a forward that fails on rank 1
    alone, which ends this process."""
    import sitecustomize

    plan, out = Path(plan_file), Path(out_file)
    group = TensorParallelGroup(GroupSpec(degree=2, failure_skew=5.0))
    sharded = group.load(ModelSpec(checkpoint, None, "float32"))
    # the second layer of the next forward (every rank runs the same layers), on both ranks
    plan.write_text(json.dumps({"0": [sitecustomize.calls + 2], "1": [sitecustomize.calls + 2]}))
    config = DecodingConfig(gen_length=16, block_length=4, temperature=0.8, seed=3)
    report = {}
    try:
        generate(sharded, _requests(), config)
    except MemoryError as error:
        report["both"] = str(error)
    report["after"] = _tokens(generate(sharded, _requests(), config))
    out.write_text(json.dumps(report))
    plan.write_text(json.dumps({"1": [sitecustomize.calls + 2]}))  # now on rank 1 alone
    generate(sharded, _requests(), config)  # rank 1 fails: the group stops, this process ends
    out.write_text(json.dumps({**report, "alone": "decoded"}))


@pytest.mark.slow  # ~20 s, and DeepSpeed compiles its CPU all-reduce op on first use (~2.5 min)
def test_a_failure_on_one_rank_alone_stops_the_group_with_its_error(tmp_path):
    """With real DeepSpeed ranks on gloo: a failure every rank meets is the input's (rank 0
    raises it, and the group decodes exactly as before); one that rank 1 meets alone, while
    rank 0 waits for it in an all-reduce, stops the group with rank 1's error."""
    checkpoint = str(write_checkpoint(tmp_path / "sdar", "sdar"))
    config = DecodingConfig(gen_length=16, block_length=4, temperature=0.8, seed=3)
    expected = _tokens(generate(load_target(checkpoint, dtype=torch.float32), _requests(), config))
    plan, out = tmp_path / "faults.json", tmp_path / "report.json"
    code = (
        "import sys; from tests.test_tensor_parallel import drive_failures; "
        "drive_failures(*sys.argv[1:])"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SPOT_TEST_TP_FAULTS": str(plan)}
    env["PYTHONPATH"] = os.pathsep.join([str(FAULTS), str(ROOT)])
    run = subprocess.run(
        [sys.executable, "-c", code, checkpoint, str(plan), str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    report = json.loads(out.read_text())
    assert report["both"].startswith("rank 0 ran out of memory in layer call ")
    assert report["after"] == expected
    assert "alone" not in report
    assert run.returncode == 70, run.stderr[-3000:]
    stopped = run.stderr.strip().splitlines()[-1]
    assert stopped.startswith("tensor-parallel rank 1 failed: MemoryError: rank 1 ran out of")
    assert stopped.endswith("; stopping the group")


def test_degree_must_divide_heads_and_key_value_heads(tmp_path):
    checkpoint = write_checkpoint(tmp_path / "sdar", "sdar")  # 4 heads, 2 key/value heads
    assert degree_problems(checkpoint, None, 2) == []
    problems = degree_problems(checkpoint, None, 4)
    assert len(problems) == 1 and "2 key/value heads" in problems[0]
    problems = degree_problems(checkpoint, None, 3)
    assert len(problems) == 2 and "4 attention heads" in problems[0]


def test_sharding_plan_of_the_native_layers(tmp_path):
    model = load_model(write_checkpoint(tmp_path / "llada2", "llada2")).model
    # dense layer 0 and the MoE layers' shared experts are all-reduced after down_proj
    assert row_parallel_names(model) == (
        "mlp.down_proj",
        "mlp.shared_experts.down_proj",
        "self_attn.o_proj",
    )
    assert grain_size(model, 2) == 8  # shared expert width 16 over 2 ranks
    big = load_model(write_checkpoint(tmp_path / "sdar", "sdar")).model
    assert grain_size(big, 2) == 32  # intermediate 64 over 2 ranks


def test_group_needs_two_ranks():
    with pytest.raises(ValueError, match="at least 2"):
        TensorParallelGroup(GroupSpec(degree=1))


def test_job_validation_refuses_degrees_the_model_or_resources_cannot_take(tmp_path):
    checkpoint = write_checkpoint(tmp_path / "sdar", "sdar")  # 4 heads, 2 key/value heads
    prompts = write_prompts(tmp_path / "in.parquet", {"id": ["a"], "prompt": ["hi"]})
    path = tmp_path / "job.yaml"

    def load(tensor_parallel: int, dtype: str = "float32", **resources):
        model = {"tensor_parallel": tensor_parallel, "dtype": dtype}
        job = job_dict(prompts, checkpoint, tmp_path / "out", model=model, resources=resources)
        job["input"]["chat_template"] = False
        path.write_text(yaml.safe_dump(job))
        return load_job(path)

    assert load(2).model.tensor_parallel == 2
    assert load(2, "bfloat16").model.dtype == "bfloat16"
    with pytest.raises(JobError, match="does not divide the model's 2 key/value heads"):
        load(4)
    with pytest.raises(JobError, match="one rank per GPU"):
        load(2, num_gpus=1)
    assert load(1, "float64").model.dtype == "float64"  # float64 is fine unsharded
    with pytest.raises(JobError, match="model.dtype: tensor_parallel 2 shards with DeepSpeed"):
        load(2, "float64")
    result = CliRunner().invoke(main, ["validate", str(path)])
    assert result.exit_code == 2
    assert "model.dtype: tensor_parallel 2 shards with DeepSpeed, which runs float32 or " in (
        result.output
    )


@pytest.mark.slow  # four pipeline runs, two of them with DeepSpeed ranks: several minutes
@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_job_with_tensor_parallel_2_writes_what_tensor_parallel_1_writes(tmp_path, temperature):
    from pipeline.job import parse_job
    from pipeline.runner import Run, run_job
    from tests.pipeline_fixtures import by_key, make_tiny_sdar, read_output, word_prompts

    model = make_tiny_sdar(tmp_path / "model")
    prompts = write_prompts(
        tmp_path / "in.parquet", {"id": [f"r{i}" for i in range(5)], "prompt": word_prompts(5)}
    )
    written = {}
    for degree in (1, 2):
        out = tmp_path / f"tp{degree}"
        job = job_dict(
            prompts,
            model,
            out,
            model={"tensor_parallel": degree, "dtype": "float32"},
            decoding={"temperature": temperature, "seed": 4},
            resources={"replicas": 1, "batch_size": 3, "num_cpus": 1},
        )
        run_job(Run.prepare(parse_job(job)), echo=lambda line: None)
        written[degree] = by_key(read_output(out), "completion_token_ids", "nfe", "error")
    assert written[1] == written[2]
    assert all(error is None and tokens for tokens, _, error in written[2].values())
