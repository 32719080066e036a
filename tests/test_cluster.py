"""A two-node Ray cluster on this machine: a head and a worker started as separate processes
(`ray start --block`, distinct ports and resources), a job submitted to it by address through
the Ray Jobs API (`spot-pipeline submit --address`), replicas on both nodes, and output
identical to the same job run on an embedded single-node Ray.

Each node is stopped by terminating the `ray start --block` process this test started, which
takes its Ray processes down with it; `ray stop` would stop every Ray on the machine."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from tests.pipeline_fixtures import job_dict, make_tiny_sdar, word_prompts, write_prompts

pytestmark = pytest.mark.slow  # two Ray nodes and two job runs: about two minutes on 2 cores

ROOT = Path(__file__).resolve().parents[1]
RAY = str(Path(sys.executable).parent / "ray")
CLI = [sys.executable, "-m", "pipeline.cli"]
ROWS = 12


def _free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _env() -> dict[str, str]:
    """Every process of this cluster agrees on auth (a token file would switch it on), and
    the job's entrypoint (`python -m pipeline.cli ...`) finds this environment's python."""
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    return {**os.environ, "RAY_AUTH_MODE": "disabled", "PYTHONPATH": str(ROOT), "PATH": path}


def _node_ports(ports: list[int]) -> list[str]:
    names = (
        "node-manager-port",
        "object-manager-port",
        "dashboard-agent-listen-port",
        "dashboard-agent-grpc-port",
        "metrics-export-port",
        "runtime-env-agent-port",
    )
    return [f"--{name}={port}" for name, port in zip(names, ports)]


def _wait_for_nodes(dashboard: str, count: int, timeout: float = 120.0) -> list[dict]:
    from ray.util.state import list_nodes

    deadline = time.monotonic() + timeout
    while True:
        try:
            nodes = [n for n in list_nodes(address=dashboard) if n.state == "ALIVE"]
            if len(nodes) >= count:
                return nodes
        except Exception:  # the dashboard is not up yet
            if time.monotonic() > deadline:
                raise
        if time.monotonic() > deadline:
            raise TimeoutError(f"{count} Ray nodes did not come up in {timeout:.0f} s")
        time.sleep(1.0)


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    """Head (2 CPUs) and worker (2 CPUs, resource worker_node) as separate processes."""
    temp_dir = tmp_path_factory.mktemp("ray")
    gcs, dashboard, client, *ports = _free_ports(15)
    common = ["--block", "--disable-usage-stats", "--num-cpus=2"]
    head = subprocess.Popen(
        [
            RAY,
            "start",
            "--head",
            f"--port={gcs}",
            f"--dashboard-port={dashboard}",
            "--dashboard-host=127.0.0.1",
            "--include-dashboard=true",
            f"--ray-client-server-port={client}",
            f"--temp-dir={temp_dir}",
            *_node_ports(ports[:6]),
            *common,
        ],
        env=_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    worker = None
    address = f"http://127.0.0.1:{dashboard}"
    try:
        _wait_for_nodes(address, 1)
        worker = subprocess.Popen(
            [
                RAY,
                "start",
                f"--address=127.0.0.1:{gcs}",
                '--resources={"worker_node": 1}',
                *_node_ports(ports[6:12]),
                *common,
            ],
            env=_env(),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        nodes = _wait_for_nodes(address, 2)
        yield address, nodes
    finally:
        for process in (worker, head):
            if process is not None and process.poll() is None:
                process.terminate()
                try:
                    process.wait(60)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()


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


def test_job_submitted_by_address_runs_on_both_nodes_and_matches_one_node(two_nodes, tmp_path):
    from ray.util.state import list_actors

    address, nodes = two_nodes
    assert {bool(n.resources_total.get("worker_node")) for n in nodes} == {True, False}

    model = make_tiny_sdar(tmp_path / "model")
    cluster_job = _job_file(tmp_path, "cluster", model)
    result = subprocess.run(
        [*CLI, "submit", str(cluster_job), "--address", address],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "submitted as Ray job" in result.stdout

    replicas = [
        a
        for a in list_actors(address=address, detail=True, limit=1000)
        if "MapWorker" in a.class_name
    ]
    used = {a.node_id for a in replicas}
    assert used == {n.node_id for n in nodes}, json.dumps([a.class_name for a in replicas])

    local_job = _job_file(tmp_path, "local", model)
    env = {k: v for k, v in _env().items() if k != "RAY_ADDRESS"}
    result = subprocess.run(
        [*CLI, "submit", str(local_job)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert _completions(tmp_path / "cluster") == _completions(tmp_path / "local")
