"""Cost at cluster scale: the projection arithmetic, the report's per-replica / per-GPU rates and
corpus projection from a summary, one replica's engine measured on a sample, and
`spot-pipeline estimate` running a sample of a job's input through the job's own pipeline
here, this machine's start measured as it goes."""

from __future__ import annotations

import json
import re

import pytest
import yaml
from click.testing import CliRunner

from pipeline.cli import main
from pipeline.estimate import (
    ReplicaRates,
    block_rows,
    cluster_rows,
    cluster_sizes,
    corpus_projection,
    estimate_json,
    estimate_report,
    format_duration,
    measure,
    plan_estimate,
    project,
    sample_rows,
)
from pipeline.job import JobError, load_job, parse_job
from tests.pipeline_fixtures import job_dict, make_tiny_sdar, run_cli, word_prompts, write_prompts

INPUT_ROWS = 30


def test_projection_arithmetic():
    rates = ReplicaRates(
        tokens_per_second=100.0, tokens_per_row=50.0, startup_seconds=360.0, gpus_per_replica=2
    )
    assert rates.rows_per_second == 2.0 and rates.tokens_per_gpu_second == 50.0
    p = project(rates, tokens=3.6e6, replicas=10, price=5.0)  # 3600 s of work per replica
    assert p.wall_hours == pytest.approx(1.1)  # 0.1 h start-up + 1 h generating
    assert p.replica_hours == pytest.approx(11.0)
    assert p.gpus == 20 and p.gpu_hours == pytest.approx(22.0)
    assert p.cost_usd == pytest.approx(55.0)
    assert p.usd_per_million_tokens == pytest.approx(55.0 / 3.6)
    with pytest.raises(ValueError, match="replicas"):
        project(rates, 1.0, 0, 1.0)
    assert cluster_sizes(2) == [2, 4, 8, 16, 32]
    assert cluster_sizes(2, most_useful=9) == [2, 4, 8]  # no more replicas than batches


def test_durations_read_as_a_person_reads_them():
    assert format_duration(0.04) == "0.0 s"
    assert format_duration(4.24) == "4.2 s"
    assert format_duration(9.96) == "10 s"
    assert format_duration(54.4) == "54 s"
    assert format_duration(59.6) == "1 min"
    assert format_duration(200) == "3 min 20 s"
    assert format_duration(3599.7) == "1 h"
    assert format_duration(3 * 3600 + 20 * 60 + 10) == "3 h 20 min"
    assert format_duration(0.015 * 3600) == "54 s"
    assert format_duration(2 * 86400 + 5 * 3600 + 1000) == "2 d 5 h"
    assert format_duration(86400 - 10) == "1 d"


def test_job_prices_per_gpu_or_per_replica():
    job = {"name": "x", "input": {"path": "a"}, "model": {"path": "m"}, "output": {"path": "o"}}
    both = {**job, "cost": {"usd_per_gpu_hour": 2.0, "usd_per_replica_hour": 5.0}}
    with pytest.raises(JobError, match="not both"):
        parse_job(both)
    per_gpu = parse_job({**job, "cost": {"usd_per_gpu_hour": 2.0}})
    assert per_gpu.cost.replica_hour_price(4) == 8.0
    per_replica = parse_job({**job, "cost": {"usd_per_replica_hour": 5.0}})
    assert per_replica.cost.replica_hour_price(4) == 5.0


def _summary(tokens: int, rows: int, wall: float, replicas: int, gpus: float) -> dict:
    replica_hours = wall * replicas / 3600
    return {
        "job": {
            "resources": {"replicas": replicas, "num_gpus": gpus},
            "cost": {"usd_per_replica_hour": 0.0, "usd_per_gpu_hour": 2.0},
        },
        "totals": {"generated_tokens": tokens, "rows": rows},
        "replica_hours": replica_hours,
    }


def test_report_rates_and_corpus_projection_from_a_summary():
    summary = _summary(tokens=7200, rows=72, wall=1800.0, replicas=2, gpus=2)
    rows = dict(cluster_rows(summary))
    assert rows["tokens / s per replica"] == "2.00"  # 7200 tokens / 3600 replica-seconds
    assert rows["tokens / s per GPU"] == "1.00"
    assert rows["GPU-hours"] == "2.0000"
    text = corpus_projection(summary, 14400)
    lines = text.splitlines()
    first = lines[2].split()  # 4 GPUs = 2 replicas: 14400 / (2 tok/s x 2) = 1 h
    assert first[:4] == ["4", "2", "1", "h"]
    assert first[4:7] == ["2.000", "4.000", "8.00"]  # replica-h, GPU-h, at $2 per GPU-hour
    assert len(lines) == 8  # title, header, 5 cluster sizes, assumptions
    cpu = _summary(tokens=10, rows=1, wall=10.0, replicas=1, gpus=0)
    assert dict(cluster_rows(cpu))["tokens / s per GPU"] == "-"
    with pytest.raises(ValueError, match="no tokens"):
        corpus_projection(_summary(0, 1, 10.0, 1, 0), 1e9)


@pytest.fixture(scope="module")
def job_file(tmp_path_factory):
    root = tmp_path_factory.mktemp("estimate")
    model = make_tiny_sdar(root / "model")
    prompts = write_prompts(
        root / "prompts.parquet",
        {"id": [f"p{i}" for i in range(INPUT_ROWS)], "prompt": word_prompts(INPUT_ROWS)},
    )
    job = job_dict(
        prompts,
        model,
        root / "out",
        decoding={"samples_per_prompt": 2, "temperature": 0.8},
        resources={"replicas": 2, "batch_size": 4, "num_cpus": 1, "num_gpus": 0},
        cost={"usd_per_replica_hour": 3.0},
    )
    path = root / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def test_estimate_measures_one_replica_on_a_sample(job_file):
    job = load_job(job_file)
    rows, input_rows = sample_rows(job, 3, seed=1)
    assert input_rows == INPUT_ROWS and rows.num_rows == 6  # 3 rows x 2 samples
    again, _ = sample_rows(job, 3, seed=1)
    assert again.column("id").to_pylist() == rows.column("id").to_pylist()
    assert sample_rows(job, 3, seed=2)[0].column("id") != rows.column("id")
    measurement = measure(job, rows)
    rates = measurement.rates
    assert measurement.sample_rows == 6 and measurement.errors == 0
    assert rates.tokens_per_second > 0 and rates.startup_seconds > 0
    assert measurement.nfe_per_row >= 1
    estimate = plan_estimate(job, measurement, input_rows)
    report = estimate_report(estimate)
    assert f"{INPUT_ROWS} rows x 2 samples = {2 * INPUT_ROWS} rows" in report
    table = [line for line in report.splitlines() if line[:6].strip().isdigit()]
    assert {line.split()[0] for line in table} == {"0"}  # a CPU job: no GPUs
    assert [int(line.split()[1]) for line in table] == [2, 4, 8]  # 15 batches: 16 would idle
    tokens = 2 * INPUT_ROWS * rates.tokens_per_row
    expected = project(rates, tokens, 2, 3.0)
    assert estimate.projections[0] == expected
    assert table[0][18:30].strip() == format_duration(expected.wall_seconds)
    assert f"about {estimate_json(estimate)['configured']['wall']}" in report
    assert float(table[0].split()[-2]) == pytest.approx(expected.cost_usd, abs=0.01)


@pytest.mark.e2e
def test_estimate_runs_the_jobs_pipeline_and_measures_this_machines_start(job_file):
    """The command through the installed entry point: one block of the job (the default
    sample) through an embedded Ray and one replica; the start-up it projects is what that
    run paid besides generating, measured phase by phase; only the JSON on stdout."""
    result = run_cli("estimate", str(job_file), "--json", timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads(result.stdout)
    assert data["input_rows"] == INPUT_ROWS and data["output_rows"] == 2 * INPUT_ROWS
    block = block_rows(load_job(job_file), INPUT_ROWS)
    assert data["sample"]["rows"] == block // 2 * 2  # whole input rows of 2 samples each
    start = data["start"]
    assert set(start) == {"driver", "ray", "replica", "rest"}
    assert start["driver"] > 0 and start["ray"] > 0 and start["replica"] > 0
    rates = data["rates"]
    assert rates["startup_seconds"] == pytest.approx(sum(start.values()))
    counts = [entry["replicas"] for entry in data["projections"]]
    assert counts == [2, 4, 8]  # 15 batches of work: 16 replicas would idle
    configured = data["configured"]
    assert configured == data["projections"][0]
    tokens = data["generated_tokens"]
    rate = rates["tokens_per_second_per_replica"]
    assert configured["wall_seconds"] == pytest.approx(rates["startup_seconds"] + tokens / 2 / rate)
    for entry in data["projections"]:
        assert entry["wall"] == format_duration(entry["wall_seconds"])
        assert entry["cost_usd"] == pytest.approx(entry["replica_hours"] * 3.0)
    assert "model loaded on 1/1 replicas" in result.stderr  # the sample run's own lines
    assert "INFO" not in result.stderr  # Ray's went to the sample run's log


@pytest.mark.e2e
def test_estimate_text_names_the_start_it_measured(job_file):
    args = ["estimate", str(job_file), "--sample", "2", "--set", "resources.replicas=1"]
    result = run_cli(*args, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "whole input: 30 rows" in result.stdout and "assumptions:" in result.stdout
    assert re.search(
        r"start-up here: this process [\d.]+ s, Ray [\d.]+ s, a replica's start and model "
        r"load [\d.]+ s, the rest of the run besides generating [\d.]+ s",
        result.stdout,
    )
    text = result.stdout.split("configured:")[1].splitlines()[0]
    assert re.fullmatch(r" 1 replica\(s\), the first line: about (\d+ s|\d+ min( \d+ s)?)", text)
    bad = CliRunner().invoke(main, ["estimate", str(job_file), "--sample", "0"])
    assert bad.exit_code != 0 and "--sample" in bad.output


def test_estimate_of_a_gpu_job_runs_on_cpu_here_and_prices_its_gpus(job_file):
    job = load_job(
        job_file, ["resources.num_gpus=1", "cost.usd_per_replica_hour=0", "cost.usd_per_gpu_hour=2"]
    )
    rows, input_rows = sample_rows(job, 2)
    measurement = measure(job, rows)
    assert measurement.errors == 0 and measurement.rates.gpus_per_replica == 1
    report = estimate_report(plan_estimate(job, measurement, input_rows))
    assert "measured on this machine (CPU)" in report and "no GPU here" in report
    table = [line.split() for line in report.splitlines() if line[:6].strip().isdigit()]
    first = table[0]
    assert first[:2] == ["2", "2"]  # 2 replicas of 1 GPU
    assert float(first[-2]) == pytest.approx(float(first[-3]) * 2, abs=0.02)  # GPU-h x $2
