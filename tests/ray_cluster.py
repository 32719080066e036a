"""A Ray cluster of separate nodes on this machine, for the cluster tests: each node is a
`ray start --block` process on its own ports, with its own custom resource.

Every process of it (nodes, `spot-pipeline` commands, state queries) runs with the same token
authentication (RAY_AUTH_MODE=token and a random RAY_AUTH_TOKEN, as a real cluster should) and
with TMPDIR inside the cluster's folder, so what a test leaves behind can be checked. State
queries run in a subprocess with that environment, so the test process's own Ray settings
never meet the cluster's. A node is stopped by terminating its `ray start --block` process,
which takes its Ray processes down with it (`ray stop` would stop every Ray on the machine);
`kill_node` kills the whole process tree at once, as a machine that is lost.

    python -m tests.ray_cluster http://127.0.0.1:8265 actors   # JSON, for the tests
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
RAY = str(Path(sys.executable).parent / "ray")
PORT_NAMES = (
    "node-manager-port",
    "object-manager-port",
    "dashboard-agent-listen-port",
    "dashboard-agent-grpc-port",
    "metrics-export-port",
    "runtime-env-agent-port",
)


def free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


class LocalCluster:
    """A head node, then `add_node` for more; `stop()` ends them all and removes the folder."""

    def __init__(self) -> None:
        # short paths: Ray's Unix sockets live under the temp dir (a 107-byte limit)
        self.folder = Path(tempfile.mkdtemp(prefix="spot-cl-"))
        self.tmp = self.folder / "tmp"
        self.tmp.mkdir()
        self.token = secrets.token_hex(16)
        self.gcs, self.dashboard_port, self.client_port = free_ports(3)
        self.address = f"http://127.0.0.1:{self.dashboard_port}"
        self.nodes: dict[str, subprocess.Popen] = {}

    @property
    def env(self) -> dict[str, str]:
        """The environment of every process of this cluster: its token, its TMPDIR, and this
        checkout and python first (the job's entrypoint runs `python -m pipeline.cli`)."""
        path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
        env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS",)}
        return env | {
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN": self.token,
            "TMPDIR": str(self.tmp),
            "PYTHONPATH": str(ROOT),
            "PATH": path,
        }

    def start_head(self, num_cpus: int, resources: dict[str, float]) -> None:
        self._start(
            "head",
            [
                "--head",
                f"--port={self.gcs}",
                f"--dashboard-port={self.dashboard_port}",
                "--dashboard-host=127.0.0.1",
                "--include-dashboard=true",
                f"--ray-client-server-port={self.client_port}",
                f"--temp-dir={self.folder / 'ray'}",
            ],
            num_cpus,
            resources,
        )

    def add_node(self, name: str, num_cpus: int, resources: dict[str, float]) -> None:
        self._start(name, [f"--address=127.0.0.1:{self.gcs}"], num_cpus, resources)

    def _start(self, name: str, args: list[str], num_cpus: int, resources: dict) -> None:
        ports = [f"--{n}={p}" for n, p in zip(PORT_NAMES, free_ports(len(PORT_NAMES)))]
        self.nodes[name] = subprocess.Popen(
            [
                RAY,
                "start",
                "--block",
                "--disable-usage-stats",
                f"--num-cpus={num_cpus}",
                f"--resources={json.dumps(resources)}",
                *args,
                *ports,
            ],
            env=self.env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.wait_for_nodes(len(self.nodes))

    def state(self, kind: str) -> list[dict]:
        """`actors` or `nodes` of the cluster, as the state API lists them."""
        result = subprocess.run(
            [sys.executable, "-m", "tests.ray_cluster", self.address, kind],
            cwd=ROOT,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        if result.returncode:
            raise RuntimeError(f"cannot list {kind}: {result.stderr[-2000:]}")
        return json.loads(result.stdout)

    def wait_for_nodes(self, count: int, timeout: float = 180.0) -> list[dict]:
        deadline = time.monotonic() + timeout
        while True:
            for name, node in self.nodes.items():
                if node.poll() is not None:
                    raise RuntimeError(f"Ray node {name} exited with {node.returncode}")
            try:
                alive = [n for n in self.state("nodes") if n["state"] == "ALIVE"]
                if len(alive) >= count:
                    return alive
            except RuntimeError:  # the dashboard is not up yet
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{count} Ray nodes did not come up in {timeout:.0f} s")
            time.sleep(1.0)

    def processes(self, name: str) -> list[psutil.Process]:
        """A node's `ray start` process and every process under it (GCS, raylet, workers)."""
        try:
            top = psutil.Process(self.nodes[name].pid)
            return [top, *top.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def kill_node(self, name: str) -> None:
        """Lose a node at once: SIGKILL its whole process tree."""
        for process in self.processes(name):
            with contextlib.suppress(psutil.NoSuchProcess):
                process.send_signal(signal.SIGKILL)
        self.nodes[name].wait()

    def stop(self, graceful: bool = True) -> tuple[list[str], list[str]]:
        """Stop every node (workers first) and remove the cluster's folder; returns the
        processes that outlived their node (killed then) and what was left in TMPDIR.
        Not `graceful`: kill every node at once (a head that has run jobs takes about 30 s
        to stop gracefully; `tests/test_cluster_faults.py` checks that stop)."""
        everything = [p for name in self.nodes for p in self.processes(name)]
        for name in reversed(list(self.nodes)):
            node = self.nodes[name]
            if not graceful:
                self.kill_node(name)
            elif node.poll() is None:
                node.terminate()
                try:
                    node.wait(60)
                except subprocess.TimeoutExpired:
                    node.kill()
                    node.wait()
        alive, deadline = everything, time.monotonic() + 30
        while alive and time.monotonic() < deadline:
            alive = [p for p in alive if _running(p)]
            time.sleep(0.2 if alive else 0)
        survivors = []
        for process in alive:
            with contextlib.suppress(psutil.NoSuchProcess):
                survivors.append(f"{process.pid} {' '.join(process.cmdline())[:200]}")
                process.kill()
        left = sorted(p.name for p in self.tmp.iterdir()) if self.tmp.is_dir() else []
        shutil.rmtree(self.folder, ignore_errors=True)
        return survivors, left


def _running(process: psutil.Process) -> bool:
    """Still running: neither gone nor ended and left unreaped (a zombie: where nothing
    reaps orphans, as in some containers, waiting for it to go never ends)."""
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@contextmanager
def two_nodes(graceful_stop: bool = True) -> Iterator[LocalCluster]:
    """Head (2 logical CPUs, resource head_node) and worker (2 logical CPUs, resource
    worker_node): at least 2 CPUs a node, or the Parquet read's ListFiles task, which wants
    a whole CPU, can wait forever behind the replicas."""
    cluster = LocalCluster()
    try:
        cluster.start_head(2, {"head_node": 1})
        cluster.add_node("worker", 2, {"worker_node": 1})
        yield cluster
    finally:
        cluster.stop(graceful_stop)


def _main(address: str, kind: str) -> None:
    from ray.util.state import list_actors, list_nodes

    listing = list_actors if kind == "actors" else list_nodes
    items = listing(address=address, limit=10_000, detail=True, raise_on_missing_output=False)
    print(json.dumps([dataclasses.asdict(item) for item in items], default=str))


if __name__ == "__main__":
    _main(*sys.argv[1:])
