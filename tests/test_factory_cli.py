"""The `spot-factory` command (bundled corpus, tokenizer and targets) stands apart from the
pipeline: its commands answer --help, and validating or running a job never imports it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from click.testing import CliRunner

from spot_factory.cli import main

REPO = Path(__file__).resolve().parents[1]


def test_help_everywhere():
    runner = CliRunner()
    top = runner.invoke(main, ["--help"])
    assert top.exit_code == 0 and "train-target" in top.output
    for command in main.list_commands(None):
        result = runner.invoke(main, [command, "--help"])
        assert result.exit_code == 0, (command, result.output)
        assert "Usage:" in result.output


def test_a_job_never_imports_the_factory():
    """`validate` and the generation engine (tokenizer and target loaded) leave the factory
    unimported."""
    code = (
        "import sys\n"
        "from click.testing import CliRunner\n"
        "from pipeline.cli import main\n"
        "from pipeline.engine import Engine\n"
        "from pipeline.job import load_job\n"
        "job, overrides = 'jobs/synthetic.yaml', ['drafter.budget=4']\n"
        "result = CliRunner().invoke(main, ['validate', job, '--set', overrides[0]])\n"
        "assert result.exit_code == 0, result.output\n"
        "Engine(load_job(job, overrides))\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'spot_factory'))\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip().splitlines()[-1] == "[]"


def test_commands_that_write_need_an_output_or_into_package(tmp_path):
    """Nothing rewrites the installed package's assets unless told to."""
    runner = CliRunner()
    for args in (["build-corpus"], ["train-target", "sdar-nano", "--steps", "2"]):
        result = runner.invoke(main, args)
        assert result.exit_code == 2, result.output
        assert "give --output DIR, or --into-package to replace the bundled files" in result.output
        result = runner.invoke(main, [*args, "--output", str(tmp_path), "--into-package"])
        assert result.exit_code == 2 and "not both" in result.output
    assert not any(tmp_path.iterdir())


def test_train_target_takes_the_tokenizer_it_is_given(tmp_path):
    from spot.builtin import resolve_builtin

    tokenizer = tmp_path / "tokenizer"
    tokenizer.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        text = (resolve_builtin("tokenizer") / name).read_text()
        (tokenizer / name).write_text(
            text.replace('"model_max_length": 512', '"model_max_length": 99')
        )
    out = tmp_path / "nano"
    args = ["train-target", "sdar-nano", "--output", str(out), "--tokenizer", str(tokenizer)]
    result = CliRunner().invoke(main, [*args, "--steps", "2", "--batch-size", "2"])
    assert result.exit_code == 0, result.output
    assert '"model_max_length": 99' in (out / "tokenizer_config.json").read_text()
