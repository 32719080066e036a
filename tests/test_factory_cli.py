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
