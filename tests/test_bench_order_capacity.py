"""The order-capacity benchmark: every size trained alike, its row and its checkpoint."""

import importlib.util
import sys
from pathlib import Path

from click.testing import CliRunner

from pipeline.cli import main as cli
from spot.drafters.registry import load_order_model

spec = importlib.util.spec_from_file_location(
    "bench_order_capacity", Path(__file__).parents[1] / "bench" / "order_capacity.py"
)
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)


def test_each_size_is_trained_measured_and_kept(tmp_path, monkeypatch, capsys):
    traj = tmp_path / "nano.pt"
    record = ["record-trajectories", "--model", "builtin:sdar-nano", "--out", str(traj)]
    record += ["--prompts", "24", "--block-length", "16", "--gen-length", "32"]
    result = CliRunner().invoke(cli, record)
    assert result.exit_code == 0, result.output
    argv = ["order_capacity.py", "--trajectories", str(traj), "--model", "builtin:sdar-nano"]
    argv += ["--sizes", "32x1x64,48x2x96", "--epochs", "2", "--budget", "4"]
    argv += ["--eval-prompts", "2", "--out-dir", str(tmp_path / "out")]
    monkeypatch.setattr(sys, "argv", argv)
    bench.main()
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert [row.split(" | ")[0] for row in rows[1:]] == ["| 32x1x64", "| 48x2x96"]
    for name, (d_model, layers) in {"32x1x64": (32, 1), "48x2x96": (48, 2)}.items():
        model, header = load_order_model(tmp_path / "out" / f"spot-{name}.safetensors", "spot")
        assert (model.config.d_model, model.config.num_layers) == (d_model, layers)
        params = sum(p.numel() for p in model.parameters())
        row = next(r for r in rows if r.startswith(f"| {name} "))
        assert f"| {params / 1e6:.2f}M |" in row
        curve = header["acceptance_curve"]
        assert curve["budgets"][-1] == 4 and curve["steps_per_forward"][0] == 1.0
        assert f"| {curve['steps_per_forward'][-1]:.2f} |" in row
        assert "requests" not in header["trained_on"]
