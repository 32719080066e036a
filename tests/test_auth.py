"""The embedded Ray of `spot-pipeline submit` is no open door, checked the way the open door
was found: while a real job runs, other processes on this machine try to join its cluster
with `ray.init(address=...)` and no token, at the machine's network address and at 127.0.0.1.
Both are refused within a bounded time, the job completes, and nothing is written to ~/.ray.
The same for two embedded clusters in turn in a process that imported ray first: what the
pipeline relies on in Ray's public settings, checked wherever Ray is upgraded."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from pipeline.cli import main
from pipeline.ray_auth import AUTH_MODE, AUTH_TOKEN, private_token
from tests.pipeline_fixtures import job_dict, make_tiny_sdar, word_prompts, write_prompts

REPO = Path(__file__).resolve().parents[1]
# The job must outlast both clients' attempts (up to ~45 s): a 500-row job ran ~40 s on a
# quiet 2-core machine and once ended first; 1,200 rows run ~100 s there.
ROWS = 1200

# A client joining a cluster and running code there; prints what happened. One connection
# attempt (Ray retries 20 times by default, about 40 s each, when nothing answers).
CLIENT = """
import sys
import ray
try:
    ray.init(address=sys.argv[1], configure_logging=False, log_to_driver=False)
    print("ran code:", ray.get(ray.remote(lambda: 1).remote(), timeout=30))
except Exception as error:
    print("refused:", type(error).__name__)
"""


def _network_address() -> str | None:
    """This machine's first address that is not loopback (`hostname -I`)."""
    try:
        found = subprocess.run(["hostname", "-I"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    addresses = [a for a in found.stdout.split() if ":" not in a and not a.startswith("127.")]
    return addresses[0] if addresses else None


def _wait_for_gcs_port(temp: Path, job: subprocess.Popen, log: Path, seconds: float) -> int:
    """The GCS port of the job's Ray, from the session folder under the job's TMPDIR."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        ports = list(temp.glob("spot-ray-*/ray/session_latest/gcs_server_port_*"))
        if ports and ports[0].read_text().strip():
            return int(ports[0].read_text())
        assert job.poll() is None, log.read_text()[-3000:]
        time.sleep(0.5)
    raise AssertionError("the job's Ray did not start")


def _listening(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=5).close()
        return True
    except OSError:
        return False


@pytest.mark.e2e
def test_a_client_without_the_token_is_refused_while_a_job_runs(tmp_path):
    address = _network_address()
    if address is None:
        pytest.skip("this machine has no network address besides loopback")
    make_tiny_sdar(tmp_path / "model")
    prompts = write_prompts(
        tmp_path / "prompts.parquet", {"id": list(range(ROWS)), "prompt": word_prompts(ROWS)}
    )
    job_file = tmp_path / "job.yaml"
    job = job_dict(prompts, tmp_path / "model", tmp_path / "out", decoding={"gen_length": 128})
    job_file.write_text(yaml.safe_dump(job))
    temp = Path(tempfile.mkdtemp(prefix="auth-", dir="/tmp"))  # Ray's socket paths stay short
    home = temp / "home"
    home.mkdir()
    base = {**os.environ, "PYTHONPATH": str(REPO), "HOME": str(home), "TMPDIR": str(temp)}
    for key in ("RAY_ADDRESS", AUTH_MODE, AUTH_TOKEN):
        base.pop(key, None)
    log = temp / "job.log"
    running = None
    try:
        with log.open("w") as sink:
            running = subprocess.Popen(
                [sys.executable, "-m", "pipeline.cli", "submit", str(job_file)],
                cwd=REPO,
                env={**base, AUTH_MODE: "disabled"},  # the job makes its own token regardless
                stdout=sink,
                stderr=subprocess.STDOUT,
            )
            port = _wait_for_gcs_port(temp, running, log, seconds=240)
            assert not _listening(address, port)  # nothing listens on the network address
            assert _listening("127.0.0.1", port)  # the GCS is there, on loopback only
            clients = {
                "network": subprocess.Popen(
                    [sys.executable, "-c", CLIENT, f"{address}:{port}"],
                    env={**base, "RAY_NUM_REDIS_GET_RETRIES": "1"},
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                ),
                "loopback": subprocess.Popen(  # Ray would rewrite 127.0.0.1 to the network one
                    [sys.executable, "-c", CLIENT, f"127.0.0.1:{port}"],
                    env={
                        **base,
                        "RAY_NUM_REDIS_GET_RETRIES": "1",
                        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
                    },
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                ),
            }
            started = time.monotonic()
            said = {name: client.communicate(timeout=180) for name, client in clients.items()}
            waited = time.monotonic() - started
            assert running.poll() is None, "the job ended before the clients were refused"
            running.send_signal(signal.SIGTERM)  # what it wrote is kept; no need to finish
            assert running.wait(timeout=300) == 143, log.read_text()[-3000:]
        for name, (stdout, stderr) in said.items():
            assert "ran code" not in stdout, (name, stdout)
            assert "refused: ConnectionError" in stdout, (name, stdout, stderr[-2000:])
        assert "InvalidAuthToken" in said["loopback"][1]  # the GCS itself turned it away
        assert waited < 120
        out = log.read_text()
        assert "rows kept" in out and "left; resubmit to continue" in out, out[-3000:]
        assert not (home / ".ray").exists()
        assert not list(temp.glob("spot-ray-*"))  # the run's Ray files are gone
    finally:
        if running is not None and running.poll() is None:
            running.kill()
        shutil.rmtree(temp, ignore_errors=True)


def test_the_token_is_in_the_environment_only_while_a_cluster_lives(monkeypatch):
    """One token per process (Ray keeps the first a process uses), new in every process."""
    monkeypatch.setenv(AUTH_MODE, "disabled")
    monkeypatch.delenv(AUTH_TOKEN, raising=False)
    with private_token() as first:
        assert os.environ[AUTH_TOKEN] == first and len(first) == 64
        # where ray is imported already, ray.init turns token authentication on itself
        assert os.environ.get(AUTH_MODE) == (None if "ray" in sys.modules else "token")
    assert os.environ[AUTH_MODE] == "disabled" and AUTH_TOKEN not in os.environ
    with private_token() as second:
        assert second == first
    code = "from pipeline.ray_auth import private_token as p; print(p().__enter__())"
    other = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert other.returncode == 0 and len(other.stdout.strip()) == 64
    assert other.stdout.strip() != first


# A process that imported ray before it knew of any token starts two embedded clusters in
# turn; while each runs, a client without the token tries to join it. Prints what happened.
TWO_CLUSTERS = """
import os, subprocess, sys
import ray
from pipeline.ray_auth import embedded_ray

client, env = sys.argv[1], {**os.environ, "RAY_NUM_REDIS_GET_RETRIES": "1"}
for run in range(2):
    with embedded_ray(num_cpus=1):
        print("driver ran:", ray.get(ray.remote(lambda: run).remote(), timeout=60))
        port = ray.get_runtime_context().gcs_address.rsplit(":", 1)[1]
        joined = subprocess.run(
            [sys.executable, "-c", client, "127.0.0.1:" + port],
            env=env, capture_output=True, text=True, timeout=120,
        )
        print(joined.stdout.strip(), "(InvalidAuthToken)" * ("InvalidAuthToken" in joined.stderr))
print("after:", os.environ.get("RAY_AUTH_MODE"), "RAY_AUTH_TOKEN" in os.environ)
"""


@pytest.mark.e2e
def test_each_embedded_cluster_of_a_process_refuses_clients_without_the_token(tmp_path):
    """What the embedded clusters rely on in Ray (pinned in pyproject.toml): with ray imported
    under RAY_AUTH_MODE=disabled, `ray.init` of a new local cluster with the mode unset turns
    token authentication on and takes RAY_AUTH_TOKEN, for a second cluster of the process as
    well; RAY_TMPDIR holds its files; ~/.ray stays untouched."""
    home, temp = tmp_path / "home", Path(tempfile.mkdtemp(prefix="auth-", dir="/tmp"))
    home.mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO), "HOME": str(home), "TMPDIR": str(temp)}
    env.update({AUTH_MODE: "disabled", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"})
    env.pop(AUTH_TOKEN, None)
    env.pop("RAY_ADDRESS", None)
    try:
        run = subprocess.run(
            [sys.executable, "-c", TWO_CLUSTERS, CLIENT],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert run.returncode == 0, run.stderr[-3000:]
        lines = run.stdout.strip().splitlines()
        assert lines == [
            "driver ran: 0",
            "refused: ConnectionError (InvalidAuthToken)",
            "driver ran: 1",
            "refused: ConnectionError (InvalidAuthToken)",
            "after: disabled False",
        ], run.stdout + run.stderr[-3000:]
        assert not (home / ".ray").exists()
        assert not list(temp.glob("spot-ray-*"))  # each cluster's files are gone
    finally:
        shutil.rmtree(temp, ignore_errors=True)


LONG_TMPDIR_CLUSTER = """
import glob, ray
from pipeline.ray_auth import embedded_ray

with embedded_ray(num_cpus=1):
    print("driver ran:", ray.get(ray.remote(lambda: 1).remote(), timeout=60))
    print("folders in /tmp:", len(glob.glob("/tmp/spot-ray-*/ray/session_*")) > 0)
"""


def test_an_embedded_cluster_starts_under_a_long_temporary_folder(tmp_path):
    """Ray's sockets lie ~86 characters below its folder and a socket path holds 107 bytes:
    under a $TMPDIR too long for them (a test's or a batch system's), the embedded cluster
    makes its folder in /tmp instead of failing to start."""
    long = Path(tempfile.mkdtemp(prefix="a-temporary-folder-far-too-long-for-sockets-"))
    env = {**os.environ, "PYTHONPATH": str(REPO), "TMPDIR": str(long), AUTH_MODE: "disabled"}
    env.pop("RAY_ADDRESS", None)
    try:
        run = subprocess.run(
            [sys.executable, "-c", LONG_TMPDIR_CLUSTER],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert run.returncode == 0, run.stderr[-3000:]
        assert run.stdout.split() == ["driver", "ran:", "1", "folders", "in", "/tmp:", "True"]
        assert not list(long.iterdir())
    finally:
        shutil.rmtree(long, ignore_errors=True)


def test_submit_help_says_where_a_clusters_token_comes_from():
    result = CliRunner().invoke(main, ["submit", "--help"])
    assert result.exit_code == 0
    assert "$RAY_AUTH_TOKEN" in " ".join(result.output.split())
