"""The benchmarks import no command-line module: what they share with the commands lives in
plain modules (`pipeline.drafter_data`, `spot.drafters.recipes`)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench"


@pytest.mark.parametrize("script", sorted(p.name for p in BENCH.glob("*.py")))
def test_bench_imports_no_cli_module(script):
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('script', {str(BENCH / script)!r})\n"
        "module = importlib.util.module_from_spec(spec)\n"
        "sys.modules['script'] = module\n"
        "spec.loader.exec_module(module)\n"
        "print(sorted(m for m in sys.modules if m == 'click' or m.startswith('click.')))\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip().splitlines()[-1] == "[]"
