"""A job that learns its drafter while it runs (`drafter.learn`), through the real CLI on the
bundled sdar-nano target in float64: bad learning settings are refused before anything
starts, naming the key; a learning job's rows are token-identical to draft-free decoding
though its replicas take new drafters mid-job (T=0 and T=0.8, continuous batching); its
drafters and rounds are written under the output, shown in the summary and the report; a
resubmit starts from the last drafter handed out; a learned file serves another job."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml
from click.testing import CliRunner

from pipeline.cli import main
from spot.drafters.files import read_header
from spot.drafters.trajectory import Trajectories
from tests.pipeline_fixtures import run_cli

# small enough that rounds happen within a few dozen rows
LEARNING = {
    "heldout_percent": 20,
    "validation_percent": 20,
    "spiffy_rows": 8,
    "spot_rows": [16, 32],
    "epochs": 2,
    "batch_size": 32,
    "budgets": [2, 4],
    "decision_budget": 4,
    "replay_rows": 8,
}


def _job(root: Path, name: str, *, limit: int, temperature: float, drafter: dict) -> Path:
    job = {
        "name": name,
        "input": {"path": "builtin:prompts/heldout.jsonl", "limit": limit},
        "model": {"path": "builtin:sdar-nano", "dtype": "float64"},
        "drafter": drafter,
        "decoding": {"gen_length": 32, "block_length": 16, "temperature": temperature, "seed": 1},
        "resources": {"replicas": 1, "batch_size": 4, "num_cpus": 1},
        "output": {"path": str(root / name)},
    }
    path = root / f"{name}-{limit}.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def _learning(**changes) -> dict:
    return {"kind": "spot", "learn": True, "budget": 4, "learning": LEARNING | changes}


def _rows(out: Path) -> dict[str, tuple[list[int], str]]:
    table = pq.read_table(out / "data", columns=["id", "completion_token_ids", "drafter", "error"])
    assert table.column("error").null_count == table.num_rows
    return {r["id"]: (r["completion_token_ids"], r["drafter"]) for r in table.to_pylist()}


def test_bad_learning_settings_are_refused_naming_the_key(tmp_path: Path):
    job = _job(tmp_path, "bad", limit=4, temperature=0.0, drafter=_learning())
    runner = CliRunner()

    def refused(*sets: str) -> str:
        args = [x for s in sets for x in ("--set", s)]
        result = runner.invoke(main, ["validate", str(job), *args])
        assert result.exit_code == 2, result.output
        return result.output

    assert runner.invoke(main, ["validate", str(job)]).exit_code == 0
    assert "drafter.learn: the learner makes Spiffy and SPOT drafters, which draft for the " in (
        refused("decoding.rule=threshold")
    )
    assert "with tokens_per_step: 1, not decoding.rule 'static' with tokens_per_step 2" in (
        refused("decoding.tokens_per_step=2")
    )
    assert "drafter.learn: learns a spot drafter" in refused("drafter.kind=spiffy")
    assert "drafter.learning: set only with drafter.learn: true" in refused("drafter.learn=false")
    assert "drafter.learning: decision_budget 16 must be one of budgets" in (
        refused("drafter.learning.decision_budget=16")
    )
    assert "drafter.learning.spiffy_rows: Input should be greater than or equal to 1" in (
        refused("drafter.learning.spiffy_rows=0")
    )
    assert "drafter.learning.num_cpus: Input should be greater than 0" in (
        refused("drafter.learning.num_cpus=0")
    )
    assert "drafter.learning.epoch: unknown key" in refused("drafter.learning.epoch=3")
    assert "drafter.learn: learned drafters are written under output.path" in (
        refused("output.path=s3://bucket/out")
    )
    data = yaml.safe_load(job.read_text())
    data["drafter"]["learning"]["spot_rows"] = [32, 16]
    job.write_text(yaml.safe_dump(data))
    assert "drafter.learning.spot_rows: must be positive and increasing" in refused()


def _summary(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())


# T=0 swaps are checked in the default suite (test_continuous_batching); its job runs with -m slow
@pytest.mark.parametrize(
    "temperature",
    [pytest.param(0.0, marks=pytest.mark.slow), pytest.param(0.8, marks=pytest.mark.e2e)],
)
def test_a_learning_job_is_exact_resumable_and_its_drafter_serves_another(
    tmp_path: Path, temperature: float
):
    free = run_cli(
        "submit",
        str(_job(tmp_path, "free", limit=64, temperature=temperature, drafter={"kind": "none"})),
    )
    assert free.returncode == 0, free.stdout[-3000:] + free.stderr[-3000:]
    expected = {k: tokens for k, (tokens, _) in _rows(tmp_path / "free").items()}

    out = tmp_path / "learn"
    # SPOT's second round needs 56 rows: the first run's 48 and the resubmit's 16 together
    first = _job(
        tmp_path, "learn", limit=48, temperature=temperature, drafter=_learning(spot_rows=[16, 56])
    )
    learned = run_cli("submit", str(first))
    assert learned.returncode == 0, learned.stdout[-3000:] + learned.stderr[-3000:]
    rows = _rows(out)
    assert {k: tokens for k, (tokens, _) in rows.items()} == {k: expected[k] for k in rows}
    labels = {label for _, label in rows.values()}
    assert "none" in labels and len(labels) >= 2, labels  # drafters taken mid-job

    state = json.loads((out / "drafter" / "rounds.json").read_text())
    rounds = state["rounds"]
    assert [r["kind"] for r in rounds[:3]] == ["spiffy", "spiffy", "spot"]
    assert rounds[0]["adopted"] and rounds[0]["steps_per_forward_before"]["4"] == 1.0
    assert rounds[0]["steps_per_forward_after"]["4"] > 1.5
    for r in rounds:
        assert (out / "drafter" / r["file"]).is_file() and r["seconds"] > 0
        assert sum(r["rows_by_slice"].values()) == r["rows"]
    ended = _summary(out)["drafter_learning"]  # when the run ended: every row taken
    assert ended["rows_received"] == ended["rows"] == 48 and ended["recording_seconds"] > 0
    spot = out / "drafter" / rounds[2]["file"]
    learned_from = read_header(spot)["metrics"]["learned_from"]
    assert len(sum(learned_from.values(), [])) == rounds[2]["rows"]
    assert not ended["stopped"]  # two SPOT rounds come before the learner may stop
    kept = Trajectories.load(out / "drafter" / "rows")  # every row taken, for a resubmit
    assert kept.key.unique().numel() == 48
    summary = _summary(out)
    assert summary["drafter_learning"]["rounds"] == rounds
    report = CliRunner().invoke(main, ["report", str(out)])
    assert report.exit_code == 0, report.output
    assert "drafter learning:" in report.output and "1. spiffy, 8 (" in report.output
    assert "Drafter learning" in (out / "report" / "index.html").read_text()

    # a resubmit with more rows starts from the last drafter handed out, and from the rows
    # the first run recorded: its SPOT round at 56 rows comes
    current = state["current"]
    more = _job(
        tmp_path, "learn", limit=64, temperature=temperature, drafter=_learning(spot_rows=[16, 56])
    )
    resumed = run_cli("submit", str(more))
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "48 already written, 16 to generate" in resumed.stdout
    rows_after = _rows(out)
    assert {k: tokens for k, (tokens, _) in rows_after.items()} == expected
    new_labels = {label for k, (_, label) in rows_after.items() if k not in rows}
    assert "none" not in new_labels
    assert f"{current['kind']}:learned round {current['round']}" in new_labels or state["stopped"]
    again = json.loads((out / "drafter" / "rounds.json").read_text())
    assert again["rounds"][: len(rounds)] == rounds  # kept, numbering goes on
    learning = _summary(out)["drafter_learning"]
    assert (learning["rows_restored"], learning["rows_received"]) == (48, 16)
    spot_rows = [r["rows"] for r in again["rounds"] if r["kind"] == "spot"]
    assert spot_rows[0] == rounds[2]["rows"] and len(spot_rows) == 2 and spot_rows[1] >= 56
    assert again["stopped"] == (not (out / "drafter" / "rows").exists())
    assert len(_summary(out)["runs"]) == 2

    if temperature == 0.0:  # a learning job that starts from a learned file
        start = _job(
            tmp_path,
            "start",
            limit=24,
            temperature=temperature,
            drafter=_learning(spot_rows=[64]) | {"path": str(spot)},
        )
        started = run_cli("submit", str(start))
        assert started.returncode == 0, started.stdout[-3000:] + started.stderr[-3000:]
        rows_start = _rows(tmp_path / "start")
        assert {k: t for k, (t, _) in rows_start.items()} == {k: expected[k] for k in rows_start}
        assert "none" not in {label for _, label in rows_start.values()}
        first_round = json.loads((tmp_path / "start" / "drafter" / "rounds.json").read_text())
        assert first_round["rounds"][0]["steps_per_forward_before"]["4"] > 1.0  # against it
        return
    # the learned SPOT file in another job's drafter.path, budget auto reading its curve
    other = _job(
        tmp_path,
        "other",
        limit=16,
        temperature=temperature,
        drafter={"kind": "spot", "path": str(spot), "budget": "auto"},
    )
    served = run_cli("submit", str(other))
    assert served.returncode == 0, served.stdout[-3000:] + served.stderr[-3000:]
    rows_other = _rows(tmp_path / "other")
    assert {k: t for k, (t, _) in rows_other.items()} == {k: expected[k] for k in rows_other}
    assert {label for _, label in rows_other.values()} == {f"spot:{spot}"}
    assert _summary(tmp_path / "other")["totals"]["steps_per_nfe"] > 1.0
