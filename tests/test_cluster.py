"""A two-node Ray cluster on this machine (tests.ray_cluster: head and worker as separate
`ray start --block` processes with their own ports and resources, token authentication):

- a job submitted to it by address through the Ray Jobs API (`spot-pipeline submit
  --address`) runs replicas on both nodes, and its output equals the same job's on an
  embedded single-node Ray;
- a recording of a job's trajectories by its 2 replicas on the cluster (`record-trajectories
  JOB --address`) holds exactly the trajectories of the single-process recording of the same
  prompts, and `train-drafter` trains from its shard folder.

Faults (a killed replica, a lost node) are in tests/test_cluster_faults.py.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
import yaml

from tests.pipeline_fixtures import job_dict, make_tiny_sdar, word_prompts, write_prompts
from tests.ray_cluster import ROOT, LocalCluster, two_nodes

# about 4 minutes on 2 busy cores; CI runs them with -m cluster
pytestmark = [pytest.mark.cluster, pytest.mark.slow]

CLI = [sys.executable, "-m", "pipeline.cli"]
ROWS = 12


@pytest.fixture(scope="module")
def cluster():
    with two_nodes(graceful_stop=False) as cluster:  # the faults module checks a clean stop
        yield cluster


def _run(cluster: LocalCluster, args: list[str], embedded: bool = False):
    """A `spot-pipeline` command in the cluster's environment (or, embedded, without its
    token: an embedded Ray is a private cluster of its own)."""
    env = cluster.env
    if embedded:
        env = {k: v for k, v in env.items() if not k.startswith("RAY_AUTH")}
    result = subprocess.run(
        [*CLI, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def _replica_nodes(cluster: LocalCluster, actor_class: str) -> set[str]:
    """Names of the nodes (by their custom resource) that ran replicas of `actor_class` (an
    actor that was never placed has no node)."""
    nodes = {n["node_id"]: n["resources_total"] for n in cluster.state("nodes")}
    return {
        "worker" if nodes[a["node_id"]].get("worker_node") else "head"
        for a in cluster.state("actors")
        if f"MapBatches({actor_class})" in a["class_name"] and a["node_id"] in nodes
    }


def _job_file(root: Path, name: str, model: Path) -> Path:
    prompts = write_prompts(
        root / "prompts.parquet",
        {"id": [f"q{i}" for i in range(ROWS)], "prompt": word_prompts(ROWS)},
    )
    job = job_dict(
        prompts,
        model,
        root / name,
        decoding={"gen_length": 16, "block_length": 4, "temperature": 0.7, "seed": 2},
        resources={"replicas": 2, "batch_size": 2, "num_cpus": 1},
    )
    job["name"] = name
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def _completions(output: Path) -> dict[str, list[int]]:
    rows = pq.read_table(output / "data").to_pylist()
    assert len(rows) == ROWS and all(r["error"] is None for r in rows)
    return {r["id"]: r["completion_token_ids"] for r in rows}


def test_job_submitted_by_address_runs_on_both_nodes_and_matches_one_node(cluster, tmp_path):
    model = make_tiny_sdar(tmp_path / "model")
    cluster_job = _job_file(tmp_path, "cluster", model)
    result = _run(cluster, ["submit", str(cluster_job), "--address", cluster.address])
    assert "submitted as Ray job" in result.stdout
    assert _replica_nodes(cluster, "GenerationActor") == {"head", "worker"}

    local_job = _job_file(tmp_path, "local", model)
    _run(cluster, ["submit", str(local_job)], embedded=True)
    assert _completions(tmp_path / "cluster") == _completions(tmp_path / "local")


def test_trajectories_recorded_by_two_replicas_equal_one_process_and_train(cluster, tmp_path):
    from pipeline.drafter_data import corpus_prompts
    from spot.drafters.trajectory import _FIELDS, Trajectories

    count, seed = 8, 3
    prompts = corpus_prompts("train", count, seed)  # what --prompts 8 --seed 3 records
    table = {"id": [p["id"] for p in prompts], "prompt": [p["prompt"] for p in prompts]}
    decoding = {"gen_length": 32, "block_length": 16, "temperature": 0.7, "seed": seed}
    job = job_dict(
        write_prompts(tmp_path / "prompts.parquet", table),
        "builtin:sdar-nano",
        tmp_path / "unused",
        decoding={**decoding, "rule": "static", "tokens_per_step": 1, "threshold": 0.9},
        resources={"replicas": 2, "batch_size": 2, "num_cpus": 1},
    )
    job["model"] = {"path": "builtin:sdar-nano"}  # float32, as the single-process command
    job_file = tmp_path / "record.yaml"
    job_file.write_text(yaml.safe_dump(job))
    shards = tmp_path / "shards"
    record = ["record-trajectories", str(job_file), "--out", str(shards), "--hidden"]
    result = _run(cluster, [*record, "--address", cluster.address])
    assert f"recorded {count} requests" in result.stdout
    assert _replica_nodes(cluster, "RecordingActor") == {"head", "worker"}
    assert len(list(shards.glob("shard-*.pt"))) >= 2

    single = tmp_path / "single.pt"
    options = [f"--{k.replace('_', '-')}={v}" for k, v in decoding.items()]
    record = ["record-trajectories", "--model", "builtin:sdar-nano", "--out", str(single)]
    _run(cluster, [*record, "--prompts", str(count), "--hidden", *options])

    recorded, expected = Trajectories.load(shards), Trajectories.load(single).canonical()
    for name in _FIELDS:
        assert torch.equal(getattr(recorded, name), getattr(expected, name)), name
    assert torch.equal(recorded.hidden, expected.hidden)
    assert recorded.meta == expected.meta and recorded.meta["requests"] == count

    drafter = tmp_path / "spot.safetensors"
    train = ["train-drafter", "--trajectories", str(shards), "--model", "builtin:sdar-nano"]
    train += ["--out", str(drafter), "--epochs", "3", "--budget", "4", "--eval-prompts", "2"]
    _run(cluster, train)
    assert drafter.is_file()

    again = _run(cluster, ["record-trajectories", str(job_file), "--out", str(shards)])
    assert f"{count} already recorded, 0 to record" in again.stdout
