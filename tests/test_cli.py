"""The `spot-pipeline` command: help everywhere, validate, bad jobs rejected before Ray
starts, and submit -> report end to end in a subprocess (embedded Ray started and stopped
by the command itself)."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import ray
import torch
import yaml
from click.testing import CliRunner

from pipeline.cli import COMMANDS, main
from spot.builtin import resolve_builtin
from tests.pipeline_fixtures import (
    job_dict,
    make_tiny_sdar,
    run_cli,
    word_prompts,
    write_jsonl,
    write_prompts,
)

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def job_file(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("cli")
    model = make_tiny_sdar(root / "model")
    prompts = write_prompts(
        root / "prompts.parquet",
        {"id": list(range(6)), "prompt": word_prompts(6), "topic": ["sums"] * 6},
    )
    path = root / "job.yaml"
    path.write_text(yaml.safe_dump(job_dict(prompts, model, root / "out")))
    return path


def test_help_everywhere():
    runner = CliRunner()
    top = runner.invoke(main, ["--help"])
    assert top.exit_code == 0 and "submit" in top.output and "report" in top.output
    for command in main.list_commands(None):
        result = runner.invoke(main, [command, "--help"])
        assert result.exit_code == 0, (command, result.output)
        assert "Usage:" in result.output


HEAVY = ("torch", "ray")
MODULES_AFTER = f"""
import json, sys
from pipeline.cli import main
try:
    main(sys.argv[1:])
except SystemExit:
    pass
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in {HEAVY!r})))
"""


@pytest.mark.parametrize(
    "args",
    [
        ["--help"],
        *([name, "--help"] for name in ["submit", "validate", *sorted(COMMANDS)]),
        ["validate", "jobs/synthetic.yaml"],
    ],
    ids=lambda args: " ".join(args),
)
def test_help_and_validate_import_neither_torch_nor_ray(args: list[str]):
    """`spot-pipeline --help`, every command's --help and validating the shipped job start
    without torch or ray (seconds each, more on a busy machine): read from sys.modules in a
    fresh interpreter, not timed."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run(
        [sys.executable, "-c", MODULES_AFTER, *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "Usage:" in result.stdout or result.stdout.startswith("ok: ")
    assert json.loads(result.stdout.splitlines()[-1]) == []


def test_help_lists_each_command_with_its_own_short_help():
    """The summaries --help lists without importing the commands are the commands' own."""
    for name, (_, summary) in COMMANDS.items():
        command = main.get_command(None, name)
        assert command.get_short_help_str(limit=1000) == summary, name


def test_version_is_the_installed_package_version():
    from importlib.metadata import version

    result = CliRunner().invoke(main, ["--version"])
    assert result.exit_code == 0
    assert result.output == f"spot-pipeline, version {version('spot-pipeline')}\n"


def test_validate_reports_the_plan(job_file: Path):
    result = CliRunner().invoke(main, ["validate", str(job_file)])
    assert result.exit_code == 0, result.output
    assert result.output.startswith("ok: test: 6 rows in 1 file(s), 0 duplicated id(s)")


def test_bad_jobs_are_rejected_before_ray_starts(job_file: Path):
    runner = CliRunner()
    result = runner.invoke(main, ["submit", str(job_file), "--set", "decoding.block_length=5"])
    assert result.exit_code == 2
    assert "decoding.gen_length: gen_length (16) must be a multiple of" in result.output
    result = runner.invoke(main, ["submit", str(job_file), "--set", "input.prompt_column=text"])
    assert result.exit_code == 2 and "input.prompt_column: no column 'text'" in result.output
    result = runner.invoke(main, ["validate", str(job_file), "--set", "model.path=builtin:nope"])
    assert result.exit_code == 2 and "model.path: cannot resolve 'builtin:nope'" in result.output
    assert not ray.is_initialized()


def test_submit_then_report(job_file: Path):
    out = job_file.parent / "out"
    samples = ("--set", "decoding.samples_per_prompt=2", "--set", "decoding.temperature=0.8")
    submit = run_cli("submit", str(job_file), *samples, "--progress-interval", "2")
    assert submit.returncode == 0, submit.stdout[-3000:] + submit.stderr[-3000:]
    assert "0 already written, 12 to generate" in submit.stdout
    assert "[progress] 12/12 rows (0 errors)" in submit.stdout
    lines = submit.stdout.splitlines()
    assert "[test] starting Ray" in lines  # start-up phases before rows
    assert any(line.startswith("[test] model loaded on 1/1 replicas (") for line in lines)
    last_progress = [line for line in lines if line.startswith("[progress]")][-1]
    decoding = re.search(r"\| (\S+) tok/s decoding \|", last_progress)[1]
    assert re.match(
        r"\[test\] done: 12 rows \(0 errors\), \d+ tokens, mean NFE [\d.]+; "
        r"this run [\d.]+ s, [\d.]+ tok/s over the run",
        lines[-1],
    )
    assert lines[-1].endswith("" if decoding == "-" else f", {decoding} tok/s decoding")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["totals"]["rows"] == 12 and summary["job"]["decoding"]["samples_per_prompt"] == 2
    [run] = summary["runs"]
    assert run["tokens_per_second"] == run["generated_tokens"] / run["wall_seconds"]
    assert list(run["phases"]) == ["ray", "replicas_ready", "first_rows"]
    assert noise(submit.stdout + submit.stderr) == []  # Ray's lines went to the run's log
    [log] = (out / "logs").glob("submit-*.log")
    assert "0 already written, 12 to generate" in log.read_text()

    report = CliRunner().invoke(main, ["report", str(out)])
    assert report.exit_code == 0, report.output
    assert "NFE mean / p50 / p95" in report.output and "rows" in report.output
    for name in ("nfe_histogram.png", "accepted_steps_per_forward.png", "tokens_per_second.png"):
        data = (out / "report" / name).read_bytes()
        assert data.startswith(b"\x89PNG") and len(data) > 1000
    page = (out / "report" / "index.html").read_text()
    assert "nfe_histogram.png" in page and "<table>" in page

    again = run_cli("submit", str(job_file), *samples)
    assert again.returncode == 0 and "12 already written, 0 to generate" in again.stdout


def test_report_needs_a_summary(tmp_path: Path):
    result = CliRunner().invoke(main, ["report", str(tmp_path)])
    assert result.exit_code != 0 and "no summary.json" in result.output


def test_drafter_commands_record_train_adapt_and_calibrate(tmp_path: Path):
    """The reproducible drafter commands on a bundled target: threshold trajectories with
    hidden states, a SPOT-Sets model adapted from another target's (another width), a SPOT
    checkpoint's tree sharpness chosen by measured acceptance, and a Spiffy graph whose
    acceptance the calibration counts predict."""
    from spot.builtin import builtin_drafter
    from spot.drafters.files import read_header
    from spot.drafters.registry import load_order_model
    from spot.drafters.spiffy import DraftGraph

    runner = CliRunner()
    traj = tmp_path / "nano.pt"
    decoding = ["--block-length", "16", "--gen-length", "32"]
    threshold = [*decoding, "--rule", "threshold", "--threshold", "0.9"]
    args = ["record-trajectories", "--model", "builtin:sdar-nano", "--out", str(traj)]
    result = runner.invoke(main, [*args, "--prompts", "24", "--hidden", *threshold])
    assert result.exit_code == 0, result.output
    source = builtin_drafter("sdar-tiny", "spot-sets", 16, "threshold")  # width 192 -> 128
    out = tmp_path / "sets.safetensors"
    train = ["train-drafter", "--kind", "spot-sets", "--trajectories", str(traj)]
    train += ["--model", "builtin:sdar-nano", "--out", str(out), "--epochs", "3"]
    train += ["--budget", "4", "--eval-prompts", "4", "--adapt-from", str(source)]
    result = runner.invoke(main, train)
    assert result.exit_code == 0, result.output
    header = read_header(out)
    assert header["config"]["target_hidden_size"] == 128
    assert header["metrics"]["adapted_from"]["trained_on"]["model"] == "builtin:sdar-tiny"
    assert len(header["metrics"]["validation_log_likelihood_by_epoch"]) == 4
    assert header["acceptance_curve"]["steps_per_forward"][0] == 1.0
    result = runner.invoke(main, [*train[:2], "spot", *train[3:]])
    assert result.exit_code != 0 and "--adapt-from adapts SPOT-Sets" in result.output
    result = runner.invoke(main, [*train, "--objective", "order"])
    assert result.exit_code != 0 and "--objective chooses how SPOT's" in result.output
    spot_file = tmp_path / "spot.safetensors"
    spot_file.write_bytes(builtin_drafter("sdar-nano", "spot", 16).read_bytes())
    tune = ["calibrate-spot", "--drafter", str(spot_file), "--model", "builtin:sdar-nano"]
    result = runner.invoke(main, [*tune, "--prompts", "3", "--eval-prompts", "3", "--budget", "4"])
    assert result.exit_code == 0, result.output
    model, header = load_order_model(spot_file)
    calibration = header["metrics"]["tree_calibration"]
    assert len(calibration["steps_per_forward_by_prior_scale"]) == 4  # trained + 2, 4, 8
    best = max(calibration["steps_per_forward_by_prior_scale"].values())
    chosen = calibration["chosen_prior_scale"]
    assert calibration["steps_per_forward_by_prior_scale"][f"{chosen:.6g}"] == best
    assert float(model.prior_scale.detach()) == pytest.approx(chosen)
    assert header["acceptance_curve"]["budgets"][-1] == 4
    result = runner.invoke(main, [*tune, "--prior-scales", "2,-1"])
    assert result.exit_code != 0 and "--prior-scales" in result.output
    graph_file = tmp_path / "graph.json"
    calibrate = ["calibrate-spiffy", "--trajectories", str(traj), "--out", str(graph_file)]
    result = runner.invoke(main, [*calibrate, "--budget", "4"])
    assert result.exit_code == 0, result.output
    graph = DraftGraph.load(graph_file)
    assert graph.meta["rule"] == "threshold" and len(graph.paths) <= 4
    curve = graph.acceptance_curve([0, len(graph.paths)])
    assert curve.steps_per_forward[0] == 1.0 <= curve.steps_per_forward[1]


def test_train_drafter_trains_every_kind_whose_files_hold_a_network():
    """train-drafter's kinds are the registry's that hold a network, and no other."""
    from pipeline.drafter_training import TRAINERS
    from spot.drafters.registry import DRAFTERS

    assert set(TRAINERS) == {name for name, kind in DRAFTERS.items() if kind.network is not None}


def test_calibrate_spot_measures_on_the_users_prompts(tmp_path: Path):
    """--prompts-file: the first --prompts rows validate, the next --eval-prompts measure
    the curve; a file with too few rows is refused, naming the option."""
    from spot.builtin import builtin_drafter
    from spot.drafters.files import read_header

    prompts = tmp_path / "mine.jsonl"
    rows = [
        {"id": i, "prompt": f"Tom has {i} apples and buys {i + 2} more. How many?"}
        for i in range(6)
    ]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    spot_file = tmp_path / "spot.safetensors"
    spot_file.write_bytes(builtin_drafter("sdar-nano", "spot", 16).read_bytes())
    tune = ["calibrate-spot", "--drafter", str(spot_file), "--model", "builtin:sdar-nano"]
    tune += ["--prompts-file", str(prompts), "--budget", "2", "--prior-scales", "4"]
    runner = CliRunner()
    result = runner.invoke(main, [*tune, "--prompts", "3", "--eval-prompts", "4"])
    assert result.exit_code == 2 and "--prompts-file" in result.output
    assert "holds 6 prompts; 7 are needed" in result.output
    result = runner.invoke(
        main, [*tune, "--prompts", "3", "--eval-prompts", "3", "--device", "cpu"]
    )
    assert result.exit_code == 0, result.output
    calibration = read_header(spot_file)["metrics"]["tree_calibration"]
    assert calibration["prompts_file"] == str(prompts)
    assert len(calibration["steps_per_forward_by_prior_scale"]) == 2  # trained + 4


def test_drafter_commands_default_to_the_shipped_recipe(tmp_path: Path):
    """Left to their defaults, record-trajectories and train-drafter make what the shipped
    SPOT drafters were made with: 64-token generations, the `order` objective."""
    from spot.builtin import builtin_drafter
    from spot.drafters.files import read_header
    from spot.drafters.trajectory import Trajectories

    shipped = read_header(builtin_drafter("sdar-nano", "spot", 16))
    assert shipped["metrics"]["objective"] == "order"
    runner = CliRunner()
    traj = tmp_path / "nano.pt"
    record = ["record-trajectories", "--model", "builtin:sdar-nano", "--out", str(traj)]
    result = runner.invoke(main, [*record, "--prompts", "16", "--block-length", "16"])
    assert result.exit_code == 0, result.output
    assert Trajectories.load(traj).meta["gen_length"] == shipped["trained_on"]["gen_length"]
    out = tmp_path / "spot.safetensors"
    train = ["train-drafter", "--trajectories", str(traj), "--model", "builtin:sdar-nano"]
    train += ["--out", str(out), "--epochs", "2", "--budget", "4", "--eval-prompts", "2"]
    result = runner.invoke(main, train)
    assert result.exit_code == 0, result.output
    assert read_header(out)["metrics"]["objective"] == "order"


NOISE = re.compile(r"\bERROR\b|\bWARNING\b|Traceback|Warning:")


def noise(text: str) -> list[str]:
    """Lines a healthy run must not print: errors, warnings, tracebacks (Ray's or Python's)."""
    return [line for line in text.splitlines() if NOISE.search(line)]


def _refused(job_file: Path, *overrides: str, command: str = "validate") -> str:
    """The output of a command that must refuse the job before Ray starts."""
    result = CliRunner().invoke(main, [command, str(job_file), *overrides])
    assert result.exit_code == 2, result.output
    assert not ray.is_initialized()
    assert len(result.output.splitlines()) == 2, result.output  # the header, one problem
    return result.output


def test_a_family_the_checkpoint_is_not_is_refused(job_file: Path):
    expected = (
        "model.family: llada does not match the checkpoint, whose config.json model_type "
        "'sdar' is the sdar family; set model.family: sdar or leave it out"
    )
    for command in ("validate", "submit"):
        output = _refused(job_file, "--set", "model.family=llada", command=command)
        assert expected in output


def test_several_samples_at_temperature_zero_are_refused(job_file: Path, tmp_path: Path):
    """Samples of a greedy decoding would be the same completion: refused, naming both keys,
    by validate (here through the installed command) and by submit before Ray starts."""
    samples = ("--set", "decoding.samples_per_prompt=3")
    result = run_cli("validate", str(job_file), *samples, timeout=120)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.splitlines() == [
        f"invalid job {job_file}:",
        "  decoding.samples_per_prompt: samples_per_prompt (3) with decoding.temperature 0 "
        "(greedy) makes 3 identical completions at 3x the cost: set decoding.temperature "
        "above 0 to sample, or decoding.samples_per_prompt: 1",
    ]
    sampled = ("--set", "decoding.temperature=0.7")
    output = _refused(job_file, *samples, *sampled, "--set", "decoding.top_k=1", command="submit")
    assert "with decoding.top_k 1 (greedy at any decoding.temperature)" in output
    fresh = ("--set", f"output.path={tmp_path / 'out'}")
    result = CliRunner().invoke(main, ["validate", str(job_file), *samples, *sampled, *fresh])
    assert result.exit_code == 0, result.output


def test_set_takes_yaml_lists_nulls_and_mappings(job_file: Path, tmp_path: Path):
    overrides = [
        "--set",
        f"output.path={tmp_path / 'out'}",
        "--set",
        'decoding.stop=["####", "Q:"]',
        "--set",
        "input.limit=null",
        "--set",
        "resources={batch_size: 2}",
    ]
    result = run_cli("validate", str(job_file), *overrides, timeout=120)
    assert result.returncode == 0 and result.stdout.startswith("ok: test: 6 rows"), result.stderr
    output = _refused(job_file, "--set", "decoding.stop=[1]")
    assert "  decoding.stop.0: Input should be a valid string (got 1)" in output
    output = _refused(job_file, "--set", "decoding.stop=[1", command="submit")
    assert "  decoding.stop: --set cannot parse '[1' as YAML: expected ',' or ']'" in output


def test_a_prefix_cache_a_target_cannot_take_is_refused(job_file: Path, tmp_path: Path):
    """A prefix cache size asked of a bidirectional target (LLaDA) or a tensor-parallel one
    is refused naming the key and why; auto (the default) or 0 validates."""
    llada = ("--set", "model.path=builtin:llada-tiny", "--set", f"output.path={tmp_path / 'o'}")
    sized = ("--set", "resources.prefix_cache_bytes=1000000")
    output = _refused(job_file, *llada, *sized)
    assert output.splitlines()[1] == (
        "  resources.prefix_cache_bytes: bidirectional attention (LLaDA, Dream): a prompt's "
        "keys and values depend on every token after it, so no prefix cache is exact; set 0 "
        "or auto"
    )
    sharded = ("--set", "model.tensor_parallel=2", "--set", "model.dtype=float32")
    output = _refused(job_file, *sharded, *sized)
    assert output.splitlines()[1] == (
        "  resources.prefix_cache_bytes: a tensor-parallel target has no prefix cache yet; "
        "set 0 or auto"
    )
    for size in ("auto", "0"):
        result = CliRunner().invoke(
            main,
            ["validate", str(job_file), *llada, "--set", f"resources.prefix_cache_bytes={size}"],
        )
        assert result.exit_code == 0, result.output
    fresh = ("--set", f"output.path={tmp_path / 'o'}")
    result = CliRunner().invoke(main, ["validate", str(job_file), *sized, *fresh])  # SDAR takes one
    assert result.exit_code == 0, result.output


def test_an_output_path_that_is_a_file_or_inside_one_is_refused(job_file: Path, tmp_path: Path):
    taken = tmp_path / "taken.txt"
    taken.write_text("not a folder")
    output = _refused(job_file, "--set", f"output.path={taken}")
    assert f"output.path: '{taken}' is a file, not a folder" in output
    inside = taken / "out"
    output = _refused(job_file, "--set", f"output.path={inside}", command="submit")
    assert f"output.path: '{inside}' cannot be a folder: '{taken}' is a file" in output


def test_a_read_only_output_folder_is_refused(tmp_path: Path):
    """Writability is tried by writing, not read from permission bits: root writes in a
    folder without write permission (validate passes), a user without that permission is
    refused. Run as root, the refused case drops to the nobody user with setpriv."""
    shared = Path(tempfile.mkdtemp(prefix="spot-readonly-"))  # a folder nobody can read
    try:
        shared.chmod(0o755)
        prompts = write_prompts(shared / "prompts.parquet", {"id": [1], "prompt": ["hi"]})
        locked = shared / "locked"
        locked.mkdir()
        locked.chmod(0o555)
        job = job_dict(prompts, "builtin:sdar-nano", locked / "out")
        job["model"]["dtype"] = "float32"
        job_file = shared / "job.yaml"
        job_file.write_text(yaml.safe_dump(job))
        command = ["validate", str(job_file)]
        as_user = []
        if os.geteuid() == 0:
            assert run_cli(*command).returncode == 0  # root may write there
            if shutil.which("setpriv") is None:
                pytest.skip("running as root without setpriv: cannot drop to another user")
            as_user = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
            probe = [*as_user, sys.executable, "-c", "import pipeline.cli"]
            env = {**os.environ, "PYTHONPATH": str(REPO)}
            if subprocess.run(probe, cwd="/", env=env, capture_output=True).returncode:
                pytest.skip("the nobody user cannot read this checkout or its venv")
        result = subprocess.run(
            [*as_user, sys.executable, "-m", "pipeline.cli", *command],
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO), "HOME": str(shared)},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 2, result.stdout + result.stderr
        assert f"output.path: cannot write in '{locked}' (Permission denied)" in result.stderr
    finally:
        shutil.rmtree(shared, ignore_errors=True)


def test_tensor_parallel_ranks_need_the_gpus_a_machine_has(job_file: Path, tmp_path: Path):
    """tensor_parallel 2 with num_gpus 0 runs its ranks on CPU: refused on a machine with
    GPUs (a forgotten key), the way to shard on a machine without."""
    overrides = ["--set", "model.tensor_parallel=2", "--set", "model.dtype=float32"]
    overrides += ["--set", "resources.num_gpus=0", "--set", f"output.path={tmp_path / 'out'}"]
    if torch.cuda.is_available():
        output = _refused(job_file, *overrides)
        assert (
            "model.tensor_parallel: 2 ranks with resources.num_gpus: 0 would run on CPU on this "
            "machine, which has GPUs; set resources.num_gpus: 2 (one per rank)"
        ) in output
    else:
        result = CliRunner().invoke(main, ["validate", str(job_file), *overrides])
        assert result.exit_code == 0, result.output


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without GPUs")
def test_gpus_the_embedded_ray_lacks_stop_the_job_at_once(job_file: Path, tmp_path: Path):
    """A replica or a learner wanting a GPU this machine lacks would wait for it forever: the
    run stops when Ray has started, naming the key, and writes nothing."""
    learning = ["--set", "drafter={kind: spot, learn: true, learning: {num_gpus: 0.5}}"]
    for key, overrides in (
        ("resources.num_gpus", ["--set", "resources.num_gpus=1"]),
        ("drafter.learning.num_gpus", learning),
    ):
        out = tmp_path / key
        result = run_cli("submit", str(job_file), *overrides, "--set", f"output.path={out}")
        assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-2000:]
        assert f"failed: RuntimeError: {key}: " in result.stdout + result.stderr
        assert "GPU(s) wanted, and this machine's Ray has 0" in result.stdout + result.stderr
        assert not list((out / "data").glob("*.parquet"))


@pytest.mark.parametrize(
    ("file", "rows", "messages", "command", "expected"),
    [
        (
            "numbers.parquet",
            [{"id": 1, "prompt": 12}, {"id": 2, "prompt": 34}],
            False,
            "submit",
            "input.prompt_column: column 'prompt' is int64, not text",
        ),
        (
            "chats.parquet",
            [{"id": 1, "chat": '[{"role": "user"}]'}],
            True,
            "validate",
            "input.messages_column: column 'chat' is string, not a list of {role, content}",
        ),
        (
            "numbers.jsonl",
            [{"id": i, "prompt": i * 11} for i in range(3)],
            False,
            "validate",
            "input.prompt_column: column 'prompt' holds no text in the first 3 rows (e.g. 0)",
        ),
        (
            "turns.jsonl",
            [{"id": 1, "chat": "hello"}],
            True,
            "validate",
            "input.messages_column: column 'chat' holds no list of {role, content} turns",
        ),
    ],
)
def test_prompt_and_messages_columns_of_another_type_are_refused(
    job_file: Path, tmp_path: Path, file, rows, messages, command, expected
):
    path = _input_file(tmp_path / file, rows)
    chat = ["--set", "input.messages_column=chat"] if messages else []
    assert expected in _refused(job_file, "--set", f"input.path={path}", *chat, command=command)


def test_one_prompt_of_another_type_is_an_error_row_not_a_bad_job(job_file: Path, tmp_path: Path):
    rows = [{"id": 1, "prompt": 5}, {"id": 2, "prompt": "a"}]
    mixed = _input_file(tmp_path / "mixed.jsonl", rows)
    elsewhere = ["--set", f"input.path={mixed}", "--set", f"output.path={tmp_path / 'out'}"]
    result = CliRunner().invoke(main, ["validate", str(job_file), *elsewhere])
    assert result.exit_code == 0, result.output


def _input_file(path: Path, rows: list[dict]) -> Path:
    """`rows` as JSON Lines or Parquet, as the file's name says."""
    if path.suffix == ".jsonl":
        return write_jsonl(path, rows)
    return write_prompts(path, {name: [row[name] for row in rows] for name in rows[0]})


def test_a_hub_id_the_hub_cannot_give_is_refused_without_hanging(job_file: Path, tmp_path: Path):
    """Not cached, and the hub refuses connections, never answers, or is switched off."""
    hub_id = ["--set", "model.path=no-such-org/no-such-model"]
    cache = {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "0"}
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        refused_port = closed.getsockname()[1]
    with socket.socket() as silent:  # accepts connections (the kernel does) and never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        endpoints = {
            "refused": f"http://127.0.0.1:{refused_port}",
            "silent": f"http://127.0.0.1:{silent.getsockname()[1]}",
        }
        for case, endpoint in endpoints.items():
            start = time.monotonic()
            result = run_cli(
                "validate", str(job_file), *hub_id, env={**cache, "HF_ENDPOINT": endpoint}
            )
            elapsed = time.monotonic() - start
            assert result.returncode == 2, result.stdout + result.stderr
            problem = result.stderr.splitlines()[1]
            assert problem.startswith(
                "  model.path: 'no-such-org/no-such-model' is not in the local Hugging Face cache "
                "and the hub "
            ), result.stderr
            assert problem.endswith("download it first, or give a local checkpoint directory")
            wanted = "did not answer within 10 s" if case == "silent" else "cannot be reached ("
            assert wanted in problem
            assert elapsed < 60, elapsed
    result = run_cli("validate", str(job_file), *hub_id, env={**cache, "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 2
    assert "local Hugging Face cache and HF_HUB_OFFLINE is set" in result.stderr


def _nano_job(root: Path, *, limit: int, drafter: str, batch_size: int) -> Path:
    """A job on the bundled sdar-nano target, in float64 (where equal inputs give equal
    decisions whatever shares a forward): `limit` held-out prompts at T=0.8."""
    job = {
        "name": "nano",
        "input": {"path": "builtin:prompts/heldout.jsonl", "limit": limit},
        "model": {"path": "builtin:sdar-nano", "dtype": "float64"},
        "drafter": {"kind": drafter, "budget": 4},
        "decoding": {"gen_length": 32, "block_length": 16, "temperature": 0.8, "seed": 1},
        "resources": {"replicas": 1, "batch_size": batch_size, "num_cpus": 1},
        "output": {"path": str(root / "out")},
    }
    path = root / f"job-{limit}-{drafter}-{batch_size}.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def _tokens(out: Path) -> dict[str, list[int]]:
    table = pq.read_table(out / "data", columns=["id", "completion_token_ids", "error"])
    assert table.column("error").null_count == table.num_rows
    rows = table.to_pylist()
    return {r["id"]: r["completion_token_ids"] for r in rows}


@pytest.mark.e2e
def test_resume_refuses_other_settings_and_takes_another_drafter_and_batch(tmp_path: Path):
    """Rows made with one drafter and batch size, resumed with another: the corpus is what one
    run makes. A resubmit that changes what decides the tokens is refused before Ray starts,
    naming each key; --overwrite starts again."""
    out = tmp_path / "out"
    first = run_cli("submit", str(_nano_job(tmp_path, limit=3, drafter="none", batch_size=2)))
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert "0 already written, 3 to generate" in first.stdout
    assert noise(first.stdout + first.stderr) == []
    fingerprint = json.loads((out / "fingerprint.json").read_text())
    assert fingerprint["decoding.temperature"] == 0.8 and "drafter.kind" not in fingerprint

    other = _nano_job(tmp_path, limit=6, drafter="spot", batch_size=4)
    changed = ["--set", "decoding.seed=7", "--set", "input.chat_template=false"]
    refused = run_cli("submit", str(other), *changed, timeout=120)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert refused.stdout == ""  # nothing ran
    assert refused.stderr.splitlines()[1:] == [
        f"  output.path: {out} holds rows made with other settings (fingerprint.json); "
        "resuming would mix them with this job's:",
        "    input.chat_template: true -> false",
        "    decoding.seed: 1 -> 7",
        "  submit with --overwrite to delete those rows and start again, or set another "
        "output.path",
    ]

    checked = CliRunner().invoke(main, ["validate", str(other), *changed])
    assert checked.exit_code == 2 and "    decoding.seed: 1 -> 7\n" in checked.output

    resumed = run_cli("submit", str(other))  # another drafter and batch size: token-neutral
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "3 already written, 3 to generate" in resumed.stdout
    corpus = _tokens(out)
    assert len(corpus) == 6

    single = run_cli("submit", str(_nano_job(tmp_path, limit=6, drafter="none", batch_size=2)))
    assert "6 already written, 0 to generate" in single.stdout  # same fingerprint: resumes
    again = run_cli(
        "submit", str(_nano_job(tmp_path, limit=6, drafter="none", batch_size=2)), "--overwrite"
    )
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    removed = re.search(
        r"^\[nano\] --overwrite: removed (\d+) part files? \(6 rows\), "
        rf"summary.json \(3 runs\), fingerprint.json in {re.escape(str(out))} \(logs/ kept\)$",
        again.stdout,
        re.MULTILINE,
    )
    assert removed and int(removed[1]) >= 2, again.stdout  # counted before it was deleted
    assert "0 already written, 6 to generate" in again.stdout
    assert _tokens(out) == corpus
    assert json.loads((out / "summary.json").read_text())["totals"]["rows"] == 6
    logs = sorted((out / "logs").glob("submit-*.log"))
    assert len(logs) == 4  # the refusal ran nothing
    assert removed[0] in logs[-1].read_text()


@pytest.mark.e2e
def test_a_failing_job_prints_one_message_and_keeps_the_log(tmp_path: Path):
    """A checkpoint whose weights are broken passes validation (only its config is read)
    and fails in the replica: two lines on the terminal, the traceback in the run's log."""
    model = tmp_path / "model"
    shutil.copytree(resolve_builtin("targets/sdar-nano"), model)
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    job = _nano_job(tmp_path, limit=2, drafter="none", batch_size=2)
    result = run_cli("submit", str(job), "--set", f"model.path={model}")
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    assert noise(result.stdout) == []
    [log] = (tmp_path / "out" / "logs").glob("submit-*.log")
    assert result.stderr.splitlines() == [
        "[nano] failed: SafetensorError: Error while deserializing header: invalid header length",
        f"  the rows written are kept; the full log: {log}",
    ]
    text = log.read_text()
    assert "Traceback (most recent call last)" in text and "SafetensorError" in text
