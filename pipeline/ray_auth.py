"""Who may use the Ray that `submit` runs on, through Ray's public settings only.

A local Ray binds its GCS, raylet and workers to every interface, and without
authentication any process that reaches the machine's address can run code on it for as
long as the job runs. So the embedded cluster `submit` starts (`embedded_ray`) is private:

- token authentication with a token made for this process: RAY_AUTH_TOKEN=<random> in the
  environment while the cluster lives (Ray's processes inherit it; nothing is written to
  ~/.ray). Ray reads RAY_AUTH_MODE when it is imported and keeps the first token a process
  uses for the life of the process, with no public way to re-read either. So a process
  makes one token, for every embedded cluster it starts; the command sets RAY_AUTH_MODE=token
  before it imports ray (`prepare_embedded_ray`); where ray was imported first, the mode is
  left unset while the cluster starts, and `ray.init` of a new local cluster turns token
  authentication on and re-reads it itself (Ray 2.59 and later; pyproject pins the Ray
  tested);
- every address on 127.0.0.1: Ray's single-machine mode, which Ray reads when it is
  imported, so the command sets it before importing ray (`prepare_embedded_ray`);
- its files in a temporary folder of its own (RAY_TMPDIR, which Ray reads when it starts a
  cluster; `ray.init`'s `_temp_dir` is an experimental option), removed afterwards.

A cluster of one's own (`submit --address`) takes the token from $RAY_AUTH_TOKEN
(`client_token_from_environment`); its pods or nodes get theirs from a Kubernetes Secret or
an env file (infra/).

Nothing here imports ray at module level: `prepare_embedded_ray` must run before ray is
imported.
"""

from __future__ import annotations

import os
import secrets
import shutil
import sys
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

AUTH_MODE = "RAY_AUTH_MODE"
AUTH_TOKEN = "RAY_AUTH_TOKEN"
AUTH_TOKEN_PATH = "RAY_AUTH_TOKEN_PATH"
TEMP_DIR = "RAY_TMPDIR"
# Ray puts a Unix socket this far below its temp folder, and a socket's path holds at most
# 107 bytes (Ray refuses longer ones): the folder is made where the path fits.
RAY_SOCKET_TAIL = (
    "/spot-ray-xxxxxxxx/ray/session_2026-12-06_22-39-11_431153_4194304/sockets/plasma_store"
)
SOCKET_PATH_MAX = 107
# Ray's single-machine mode (its default on macOS and Windows): the node's address, and so
# every server's, is 127.0.0.1 instead of the machine's network address
LOOPBACK = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
# this process's token for the clusters it starts (Ray keeps a process's first token)
_TOKEN = secrets.token_hex(32)


def prepare_embedded_ray() -> bool:
    """Before ray is imported: the settings Ray reads then, for an embedded Ray private to
    this process (127.0.0.1 only; token authentication with this process's token, mode and
    token left set for the rest of the process). Returns False and changes nothing when ray
    is imported already (`embedded_ray` still authenticates; the loopback is lost)."""
    if "ray" in sys.modules:
        return os.environ.get(LOOPBACK) == "0"
    os.environ[LOOPBACK] = "0"
    os.environ[AUTH_MODE] = "token"
    os.environ[AUTH_TOKEN] = _TOKEN
    os.environ.pop(AUTH_TOKEN_PATH, None)
    return True


@contextmanager
def _environment(values: Mapping[str, str | None]) -> Iterator[None]:
    """`values` in the environment for the `with` block (None: unset), restored afterwards."""
    saved = {key: os.environ.get(key) for key in values}
    for key, value in values.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextmanager
def private_token() -> Iterator[str]:
    """Token authentication with this process's token for an embedded Ray started and
    stopped in the `with` block; the environment is restored afterwards."""
    settled = os.environ.get(AUTH_MODE) == "token" and os.environ.get(AUTH_TOKEN) == _TOKEN
    # "token" where ray reads it (or read it) when imported; else unset, so that ray.init
    # of a new local cluster turns token authentication on itself
    mode = "token" if settled or "ray" not in sys.modules else None
    with _environment({AUTH_MODE: mode, AUTH_TOKEN: _TOKEN, AUTH_TOKEN_PATH: None}):
        yield _TOKEN


@contextmanager
def embedded_ray(num_cpus: int) -> Iterator[None]:
    """A local Ray of `num_cpus` logical CPUs for the `with` block, private to this process
    (`private_token`), its files in a new temporary folder removed afterwards."""
    import ray

    temp_dir = tempfile.mkdtemp(prefix="spot-ray-", dir=_temp_parent())
    try:
        with private_token(), _environment({TEMP_DIR: temp_dir}):
            ray.init(num_cpus=num_cpus, include_dashboard=False, configure_logging=False)
            try:
                yield
            finally:
                ray.shutdown()
    finally:
        shutil.rmtree(temp_dir, ignore_errors=True)


def _temp_parent() -> str:
    """The system's temporary folder ($TMPDIR), or /tmp when Ray's sockets below it would
    have paths too long."""
    parent = tempfile.gettempdir()
    return parent if len(parent) + len(RAY_SOCKET_TAIL) <= SOCKET_PATH_MAX else "/tmp"


def client_token_from_environment() -> bool:
    """For `submit --address`, before ray is imported: with $RAY_AUTH_TOKEN set and
    $RAY_AUTH_MODE not, turn token authentication on so Ray's clients send the token.
    Returns whether a token is sent."""
    if os.environ.get(AUTH_TOKEN) and AUTH_MODE not in os.environ:
        if "ray" in sys.modules:
            raise RuntimeError(
                f"ray is imported already: set {AUTH_MODE}=token before it is, to send "
                f"${AUTH_TOKEN} to the cluster"
            )
        os.environ[AUTH_MODE] = "token"
    return os.environ.get(AUTH_MODE) == "token"
