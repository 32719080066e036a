"""Who may use the Ray that `submit` runs on.

A local Ray binds its GCS, raylet and workers to every interface, and without
authentication any process that reaches the machine's address can run code on it for as
long as the job runs. So the embedded cluster `submit` starts is private to the run:

- token authentication with a token made for the run: RAY_AUTH_MODE=token and
  RAY_AUTH_TOKEN=<random> in this process's environment while the cluster lives (Ray's
  processes inherit it; nothing is written to ~/.ray), and Ray's cached configuration
  re-read so a process that imported ray already uses it too;
- every address on 127.0.0.1 (`use_loopback`): Ray's single-machine mode, which Ray reads
  when it is imported, so the command sets it before importing ray.

A cluster of one's own (`submit --address`) takes the token from $RAY_AUTH_TOKEN
(`client_token_from_environment`); its pods or nodes get theirs from a Kubernetes Secret or
an env file (infra/).

Nothing here imports ray at module level: `use_loopback` must run before ray is imported.
"""

from __future__ import annotations

import os
import secrets
import sys
from collections.abc import Iterator
from contextlib import contextmanager

AUTH_MODE = "RAY_AUTH_MODE"
AUTH_TOKEN = "RAY_AUTH_TOKEN"
AUTH_TOKEN_PATH = "RAY_AUTH_TOKEN_PATH"
# Ray's single-machine mode (its default on macOS and Windows): the node's address, and so
# every server's, is 127.0.0.1 instead of the machine's network address
LOOPBACK = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def use_loopback() -> bool:
    """Make the embedded Ray of this process listen on 127.0.0.1 only. Ray reads the setting
    when it is imported: returns False (and changes nothing) when ray is imported already."""
    if "ray" in sys.modules:
        return os.environ.get(LOOPBACK) == "0"
    os.environ[LOOPBACK] = "0"
    return True


@contextmanager
def private_token() -> Iterator[str]:
    """Token authentication with a new random token for the `with` block (start and stop the
    embedded Ray inside it); the environment is restored afterwards."""
    saved = {key: os.environ.get(key) for key in (AUTH_MODE, AUTH_TOKEN, AUTH_TOKEN_PATH)}
    token = secrets.token_hex(32)
    os.environ[AUTH_MODE] = "token"
    os.environ[AUTH_TOKEN] = token
    os.environ.pop(AUTH_TOKEN_PATH, None)
    _reload_ray_settings()
    try:
        yield token
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        _reload_ray_settings()


def client_token_from_environment() -> bool:
    """For `submit --address`: with $RAY_AUTH_TOKEN set and $RAY_AUTH_MODE not, turn token
    authentication on so Ray's clients send the token. Returns whether a token is sent."""
    if os.environ.get(AUTH_TOKEN) and AUTH_MODE not in os.environ:
        os.environ[AUTH_MODE] = "token"
        _reload_ray_settings()
    return os.environ.get(AUTH_MODE) == "token"


def _reload_ray_settings() -> None:
    """Ray caches RAY_AUTH_MODE and the token when imported; re-read them (as Ray does when
    it turns authentication on itself). Nothing to do before ray is imported."""
    if "ray" not in sys.modules:
        return
    from ray._raylet import AuthenticationTokenLoader, Config

    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()
