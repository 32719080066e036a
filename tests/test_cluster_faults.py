"""Faults across nodes: a two-node Ray cluster on this machine (head and worker as separate
`ray start` processes, token authentication, a custom resource per node), jobs submitted by
address (`spot-pipeline submit --address`), and

- one replica's process killed mid-job: the job finishes without a resubmit, every
  (id, sample_index) exactly once, the tokens those of a run without Ray;
- the worker node lost mid-job (its whole process tree killed): the job finishes on the head's
  replicas or stops saying why, and a resubmit completes it, every row exactly once.

Nothing is left behind: no Ray process outlives the cluster, and no temporary folder is left
in the cluster's TMPDIR (every process of the test runs with it).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from pipeline.output import OutputDir
from tests.pipeline_fixtures import job_dict, make_tiny_sdar, word_prompts, write_prompts
from tests.ray_cluster import ROOT, LocalCluster, two_nodes

# about 5 minutes on 2 busy cores; CI runs them with -m cluster
pytestmark = [pytest.mark.cluster, pytest.mark.slow]

CLI = [sys.executable, "-m", "pipeline.cli"]
ROWS = 48  # 6 blocks of 8 rows: a replica is busy with one whenever the kill comes
DECODING = {"gen_length": 32, "block_length": 4, "temperature": 0.7, "seed": 2}
# fractional CPUs: after the worker is lost, both replicas and the read/write tasks fit the head
RESOURCES = {"replicas": 2, "batch_size": 2, "num_cpus": 0.5}
JOB_TIMEOUT = 420


@pytest.fixture(scope="module")
def cluster():
    with two_nodes() as cluster:
        yield cluster


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("faults")
    model = make_tiny_sdar(root / "model")
    ids = [f"q{i}" for i in range(ROWS)]
    prompts = write_prompts(root / "prompts.parquet", {"id": ids, "prompt": word_prompts(ROWS)})
    return root, model, prompts


@pytest.fixture(scope="module")
def reference(inputs):
    """Completion tokens of every row, from the engine in this process (no Ray)."""
    from pipeline.engine import Engine
    from pipeline.job import parse_job
    from pipeline.schema import ROW_ERROR, SAMPLE_INDEX

    root, model, prompts = inputs
    job = parse_job(job_dict(prompts, model, root / "unused", decoding=DECODING))
    table = pq.read_table(prompts)
    table = table.append_column(SAMPLE_INDEX, pa.array([0] * ROWS, pa.int64()))
    table = table.append_column(ROW_ERROR, pa.array([None] * ROWS, pa.string()))
    out = Engine(job).process(table)
    return dict(zip(out.column("id").to_pylist(), out.column("completion_token_ids").to_pylist()))


def _job_file(inputs, name: str) -> tuple[Path, Path]:
    root, model, prompts = inputs
    job = job_dict(prompts, model, root / name, decoding=DECODING, resources=RESOURCES)
    job["name"] = name
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(job))
    return path, root / name


class Submission:
    """`spot-pipeline submit JOB --address ...` running in the background, its output in a
    file (a pipe could fill up and stall it)."""

    def __init__(self, cluster: LocalCluster, job: Path):
        self.log = job.with_suffix(".log")
        self.process = subprocess.Popen(
            [*CLI, "submit", str(job), "--address", cluster.address],
            cwd=ROOT,
            env=cluster.env,
            stdout=self.log.open("w"),
            stderr=subprocess.STDOUT,
        )

    def wait(self, timeout: float = JOB_TIMEOUT) -> tuple[int, str]:
        try:
            code = self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            code = None
        return code, self.log.read_text()


def _replicas(cluster: LocalCluster, timeout: float = 240.0) -> list[dict]:
    """The job's two replicas once both are alive (one per node, by Ray Data's spreading);
    the tokenize and detokenize stages' actors are map workers too, and are left out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = [
            a
            for a in cluster.state("actors")
            if "GenerationActor" in a["class_name"] and a["state"] == "ALIVE"
        ]
        if len(alive) >= RESOURCES["replicas"]:
            return alive
        time.sleep(0.5)
    raise TimeoutError("the job's replicas did not start")


def _wait_for_parts(output: Path, count: int, submission: Submission, timeout=240.0) -> int:
    directory = OutputDir(str(output))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        parts = len(directory.part_files())
        if parts >= count:
            return parts
        if submission.process.poll() is not None:
            raise AssertionError(
                f"the job ended before its first part: {submission.log.read_text()}"
            )
        time.sleep(0.1)
    raise TimeoutError(f"no part file in {output} after {timeout:.0f} s")


def _check_output(output: Path, reference: dict[str, list[int]]) -> int:
    """Every row exactly once, no error, the reference's tokens; returns the part count."""
    table = pq.read_table(output / "data")
    keys = list(zip(table.column("id").to_pylist(), table.column("sample_index").to_pylist()))
    assert len(keys) == len(set(keys)) == ROWS, f"{len(keys)} rows, {len(set(keys))} distinct"
    assert table.column("error").null_count == ROWS
    tokens = dict(zip(table.column("id").to_pylist(), table.column("completion_token_ids")))
    assert {k: v.as_py() for k, v in tokens.items()} == reference
    assert not [p for p in (output / "data").iterdir() if p.name.startswith(".")]
    return len(OutputDir(str(output)).part_files())


def test_a_killed_replica_is_restarted_and_the_job_completes(cluster, inputs, reference):
    job, output = _job_file(inputs, "replica-killed")
    nodes = {n["node_id"]: n for n in cluster.state("nodes")}
    started = time.perf_counter()
    submission = Submission(cluster, job)
    replicas = _replicas(cluster)
    on_worker = [a for a in replicas if nodes[a["node_id"]]["resources_total"].get("worker_node")]
    assert len({a["node_id"] for a in replicas}) == 2, "the replicas did not spread over both nodes"
    victim = on_worker[0]
    parts_at_kill = _wait_for_parts(output, 1, submission)
    os.kill(int(victim["pid"]), signal.SIGKILL)

    code, log = submission.wait()
    elapsed = time.perf_counter() - started
    assert code == 0, log[-4000:]
    parts = _check_output(output, reference)
    assert parts_at_kill < parts, f"the kill came after the last block ({parts_at_kill} parts)"
    restarted = [a for a in cluster.state("actors") if a["actor_id"] == victim["actor_id"]]
    assert restarted and int(restarted[0]["num_restarts"]) >= 1, restarted
    print(f"replica killed after {parts_at_kill}/{parts} parts; job {elapsed:.0f} s")


# before the node-lost test, which leaves the cluster without its worker
def test_a_replica_killed_while_a_learned_drafter_is_handed_out_recovers(cluster, inputs, tmp_path):
    """A job that learns its drafter (one learner actor, drafters through the object store):
    the worker's replica is killed as the learner's first drafter is handed out. It is
    restarted, takes the drafter in use from the learner, and the job completes, every row
    once with the tokens of draft-free decoding in this process."""
    import json

    from pipeline.engine import Engine
    from pipeline.job import parse_job
    from pipeline.schema import ROW_ERROR, SAMPLE_INDEX

    root, _, prompts = inputs
    output = root / "learning"
    job = job_dict(prompts, "builtin:sdar-nano", output, decoding=DECODING, resources=RESOURCES)
    table = pq.read_table(prompts)
    table = table.append_column(SAMPLE_INDEX, pa.array([0] * ROWS, pa.int64()))
    table = table.append_column(ROW_ERROR, pa.array([None] * ROWS, pa.string()))
    out = Engine(parse_job(job)).process(table)
    reference = dict(zip(out.column("id").to_pylist(), out.column("completion_token_ids")))
    job["name"] = "learning"
    job["drafter"] = {
        "kind": "spot",
        "learn": True,
        "budget": 4,
        "learning": {
            "heldout_percent": 25,
            "validation_percent": 25,
            "spiffy_rows": 4,
            "spot_rows": [16],
            "epochs": 1,
            "budgets": [4],
            "decision_budget": 4,
            "replay_rows": 4,
            "num_cpus": 0.5,
        },
    }
    path = root / "learning.yaml"
    path.write_text(yaml.safe_dump(job))
    nodes = {n["node_id"]: n for n in cluster.state("nodes")}
    submission = Submission(cluster, path)
    replicas = _replicas(cluster)
    victim = next(a for a in replicas if nodes[a["node_id"]]["resources_total"].get("worker_node"))
    rounds = output / "drafter" / "rounds.json"
    deadline = time.monotonic() + 240
    while not (rounds.is_file() and json.loads(rounds.read_text())["current"]):
        assert submission.process.poll() is None, submission.log.read_text()[-4000:]
        assert time.monotonic() < deadline, "no drafter was handed out"
        time.sleep(0.05)
    os.kill(int(victim["pid"]), signal.SIGKILL)
    learners = [a for a in cluster.state("actors") if a["class_name"] == "Learner"]
    assert len(learners) == 1 and learners[0]["state"] == "ALIVE"

    code, log = submission.wait()
    assert code == 0, log[-4000:]
    _check_output(output, {k: v.as_py() for k, v in reference.items()})
    restarted = [a for a in cluster.state("actors") if a["actor_id"] == victim["actor_id"]]
    assert restarted and int(restarted[0]["num_restarts"]) >= 1, restarted
    labels = set(pq.read_table(output / "data", columns=["drafter"]).column(0).to_pylist())
    assert labels - {"none"}, labels  # rows decoded with a learned drafter


def test_a_lost_worker_node_stops_or_finishes_and_a_resubmit_completes(cluster, inputs, reference):
    job, output = _job_file(inputs, "node-lost")
    submission = Submission(cluster, job)
    _replicas(cluster)
    parts_at_kill = _wait_for_parts(output, 1, submission)
    cluster.kill_node("worker")
    started = time.perf_counter()
    code, log = submission.wait()
    assert code is not None, "the job hung after the worker was lost"
    print(f"worker lost after {parts_at_kill} parts: job ended {code}", end=" ")
    print(f"{time.perf_counter() - started:.0f} s later")
    if code != 0:
        assert "what it wrote is kept; submit again to finish" in log, log[-4000:]
        code, log = Submission(cluster, job).wait()
        assert code == 0, log[-4000:]
        assert " 0 already written" not in log, log[-4000:]
    parts = _check_output(output, reference)
    assert parts_at_kill < parts


def test_the_cluster_leaves_nothing_behind(cluster):
    """No Ray process outlives its node, and no temporary folder is left in TMPDIR but the
    one of the head's dashboard (`pymp-*`, its multiprocessing forkserver's, which Ray's
    own shutdown leaves); the cluster's folder holds TMPDIR and goes with it."""
    survivors, left = cluster.stop()
    assert survivors == []
    assert [name for name in left if not name.startswith("pymp-")] == []
    assert not cluster.folder.exists()
