"""Cluster infrastructure checked as far as it can be without a cluster: the manifests parse and
hold what KubeRay needs, the job they run passes the project's own schema, the cluster-launcher
config passes Ray's own validation, and the Dockerfile's build steps are the install script."""

from __future__ import annotations

import copy
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import ray
import yaml

from pipeline.job import parse_job

INFRA = Path(__file__).resolve().parents[1] / "infra"
ROOT = INFRA.parent


def _load(name: str) -> dict:
    return yaml.safe_load((INFRA / name).read_text())


def _containers(group: dict) -> list[dict]:
    return group["template"]["spec"]["containers"]


def _dockerfile_ray_version() -> str:
    base = re.search(r"^ARG RAY_IMAGE=\S+:(\S+?)-", (INFRA / "Dockerfile").read_text(), re.M)
    assert base, "the Dockerfile names its Ray base image in ARG RAY_IMAGE"
    return base.group(1)


def test_raycluster_has_head_and_autoscaling_gpu_workers():
    cluster = _load("kuberay/raycluster.yaml")
    assert cluster["apiVersion"] == "ray.io/v1" and cluster["kind"] == "RayCluster"
    spec = cluster["spec"]
    assert spec["enableInTreeAutoscaling"] is True
    assert spec["rayVersion"] == _dockerfile_ray_version() == ray.__version__
    head = spec["headGroupSpec"]
    assert head["rayStartParams"]["dashboard-host"] == "0.0.0.0"
    ports = {p["containerPort"] for p in _containers(head)[0]["ports"]}
    assert {6379, 8265} <= ports  # GCS and the dashboard / Jobs API
    (gpu,) = spec["workerGroupSpecs"]
    assert 0 <= gpu["minReplicas"] <= gpu["replicas"] <= gpu["maxReplicas"]
    assert gpu["maxReplicas"] > gpu["minReplicas"]
    limits = _containers(gpu)[0]["resources"]["limits"]
    assert int(limits["nvidia.com/gpu"]) >= 1
    mounts = {m["mountPath"] for m in _containers(gpu)[0]["volumeMounts"]}
    assert "/dev/shm" in mounts  # NCCL needs more shared memory than the container default
    images = {c["image"] for g in (head, gpu) for c in _containers(g)}
    assert len(images) == 1  # head and workers run the same image


def test_rayjob_runs_the_cluster_spec_and_submits_the_job():
    job = _load("kuberay/rayjob.yaml")
    cluster = _load("kuberay/raycluster.yaml")
    assert job["apiVersion"] == "ray.io/v1" and job["kind"] == "RayJob"
    spec = job["spec"]
    assert spec["shutdownAfterJobFinishes"] is True
    embedded = copy.deepcopy(spec["rayClusterSpec"])
    head = embedded["headGroupSpec"]["template"]["spec"]
    # the RayJob's cluster is the RayCluster's plus the job file mounted on the head
    (config_map,) = [v for v in head["volumes"] if "configMap" in v]
    head["volumes"].remove(config_map)
    (mount,) = [m for m in head["containers"][0]["volumeMounts"] if m["name"] == config_map["name"]]
    head["containers"][0]["volumeMounts"].remove(mount)
    assert embedded == cluster["spec"]

    command = shlex.split(spec["entrypoint"])
    assert command[:2] == ["spot-pipeline", "submit"] and "--in-cluster" in command
    job_file = Path(command[2])
    assert job_file.parent == Path(mount["mountPath"])
    kustomization = _load("kuberay/kustomization.yaml")
    (generator,) = kustomization["configMapGenerator"]
    assert generator["name"] == config_map["configMap"]["name"]
    assert generator["files"] == [job_file.name]
    assert kustomization["generatorOptions"]["disableNameSuffixHash"] is True
    assert "rayjob.yaml" in kustomization["resources"]


def test_cluster_job_file_passes_the_job_schema():
    job = parse_job(_load("kuberay/job.yaml"))
    assert job.input.path.text.startswith("s3://") and job.output.path.text.startswith("s3://")
    assert job.model.tensor_parallel > 1
    assert job.resources.num_gpus == job.model.tensor_parallel  # one GPU per rank
    cluster = _load("kuberay/raycluster.yaml")
    (gpu,) = cluster["spec"]["workerGroupSpecs"]
    pod_gpus = int(_containers(gpu)[0]["resources"]["limits"]["nvidia.com/gpu"])
    assert pod_gpus % job.model.tensor_parallel == 0  # a replica's ranks fit in one pod
    assert job.resources.replicas <= gpu["maxReplicas"] * pod_gpus // job.resources.num_gpus
    # the paths the job reads are where the pods put the checkpoint
    head = cluster["spec"]["headGroupSpec"]["template"]["spec"]
    mounts = {m["mountPath"] for m in head["containers"][0]["volumeMounts"]}
    assert any(job.model.path.text.startswith(m + "/") for m in mounts)


def _requires_the_secrets_token(container: dict) -> None:
    env = {e["name"]: e for e in container["env"]}
    assert env["RAY_AUTH_MODE"]["value"] == "token"
    assert env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"] == {
        "name": "spot-ray-auth",
        "key": "auth_token",
    }


def test_every_ray_pod_and_the_submitter_require_the_secrets_token():
    """Ray token authentication on KubeRay: the head, the workers and the RayJob's submitter
    take RAY_AUTH_TOKEN from one Kubernetes Secret, and the files say how to make it."""
    cluster = _load("kuberay/raycluster.yaml")["spec"]
    groups = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    for container in [c for group in groups for c in _containers(group)]:
        _requires_the_secrets_token(container)
    job = _load("kuberay/rayjob.yaml")["spec"]  # its cluster is the one above (test above)
    (submitter,) = job["submitterPodTemplate"]["spec"]["containers"]
    _requires_the_secrets_token(submitter)
    assert "command" not in submitter  # KubeRay supplies `ray job submit` from the entrypoint
    for name in ("kuberay/raycluster.yaml", "kuberay/rayjob.yaml"):
        assert "kubectl create secret generic spot-ray-auth" in (INFRA / name).read_text()
    assert "export RAY_AUTH_TOKEN=" in (INFRA / "kuberay/raycluster.yaml").read_text()


def test_launcher_nodes_start_ray_with_the_token_of_an_env_file():
    config = _load("aws/cluster.yaml")
    (remote,) = [r for r, local in config["file_mounts"].items() if "ray-auth.env" in local]
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        (start,) = [c for c in config[key] if "ray start" in c]
        assert start.startswith(f"set -a && . {remote} && set +a &&"), start
    text = (INFRA / "aws/cluster.yaml").read_text()
    assert "RAY_AUTH_MODE=token" in text and "--address http://127.0.0.1:8265" in text


def test_launcher_config_passes_rays_own_validation():
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = _load("aws/cluster.yaml")
    validate_config(config)
    prepared = prepare_config(copy.deepcopy(config))  # what `ray up` does before the cloud
    validate_config(prepared)
    assert prepared["provider"]["type"] == "aws"
    workers = prepared["available_node_types"]["ray.worker.gpu"]
    assert workers["resources"]["GPU"] >= 1 and workers["max_workers"] > workers["min_workers"]
    assert (
        config["docker"]["image"]
        == _load("kuberay/raycluster.yaml")["spec"]["headGroupSpec"]["template"]["spec"][
            "containers"
        ][0]["image"]
    )

    broken = copy.deepcopy(config)
    broken["available_node_types"]["ray.worker.gpu"]["gpus"] = 4  # not a launcher key
    with pytest.raises(Exception, match="gpus"):
        validate_config(broken)


def test_dockerfile_build_steps_are_the_install_script():
    text = (INFRA / "Dockerfile").read_text()
    runs = re.findall(r"^RUN (.+)$", text, re.M)
    assert len(runs) == 1 and "bash infra/install.sh" in runs[0]
    for source in re.findall(r"^COPY (?:--\S+ )*(.+) \S+$", text, re.M):
        for path in source.split():
            assert (ROOT / path).exists(), f"COPY {path}: missing"
    # the script run outside Docker copies the same files the Dockerfile does
    outside = (INFRA / "build_outside_docker.sh").read_text()
    for source in re.findall(r"^COPY (?:--\S+ )*(.+) \S+$", text, re.M):
        for path in source.split():
            assert f"$ROOT/{path}" in outside
    for script in ("install.sh", "build_outside_docker.sh"):
        subprocess.run(["bash", "-n", str(INFRA / script)], check=True)


@pytest.mark.slow
def test_image_build_steps_run_outside_docker(tmp_path):
    """The Dockerfile's build steps in a fresh virtual environment (several minutes)."""
    result = subprocess.run(
        ["bash", str(INFRA / "build_outside_docker.sh"), str(tmp_path / "venv")],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "image build steps passed" in result.stdout


def test_gpu_forward_bench_runs_tiny_on_cpu(tmp_path):
    """The GPU benchmark's smoke test: tiny models on CPU, every column computed."""
    out = tmp_path / "rows.json"
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "gpu_forward.py"),
            "--tiny",
            "--repeats=1",
            "--steps-per-forward=1:1,2:1.8,4:2.5",
            f"--json={out}",
        ],
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert {(r["model"], r["batch"], r["nodes"]) for r in rows} == {
        (m, b, n) for m in ("sdar-8b", "llada-8b") for b in (1, 2) for n in (1, 2, 4)
    }
    for r in rows:
        assert r["seconds"] > 0 and r["tokens_per_second"] > 0
        if r["nodes"] == 1:
            assert r["relative"] == 1.0 and r["speedup"] == 1.0
