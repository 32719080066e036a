"""The driver of an embedded run in a session of its own.

A signal sent to a command's process group (Ctrl-C in a terminal, `kill -TERM -PGID`, a job
runner that signals the group) reaches every process of the group. The embedded Ray's
processes (its GCS, raylet and workers, the replicas among them) are the driver's children,
so they would die at once, before the driver could drain them (`pipeline.control`). Ray starts
them in the driver's own process group and offers no setting to do otherwise; so the driver
itself runs in a child that leads a new session, and the process the user started only
forwards the signals it gets to it, once.

Nothing here imports Ray: the fork comes before it is imported, so the child starts its own.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import traceback
from collections.abc import Callable

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def own_session(body: Callable[[], None]) -> None:
    """Run `body` in a child process that leads a session (and process group) of its own;
    this process forwards SIGTERM, SIGINT and SIGHUP to it and exits with its status. So a
    signal to the command's process group reaches the run once, through its driver, and
    never the Ray processes the driver starts. If this process dies, the child gets SIGTERM
    (Linux) and stops as it would on that signal."""
    sys.stdout.flush()
    sys.stderr.flush()
    parent = os.getpid()
    child: list[int] = []  # its pid, once forked; signals before that wait in `early`
    early: list[int] = []

    def forward(signum: int, frame: object) -> None:
        if child:
            os.kill(child[0], signum)
        else:
            early.append(signum)

    saved = {s: signal.signal(s, forward) for s in FORWARDED}
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            for s, handler in saved.items():
                signal.signal(s, handler)
            os.setsid()
            _terminate_with_parent(parent)
            body()
            code = 0
        except SystemExit as exit:
            code = exit.code if isinstance(exit.code, int) else (0 if exit.code is None else 1)
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    child.append(pid)
    for signum in early:
        os.kill(pid, signum)
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    sys.exit(code if code >= 0 else 128 - code)


def _terminate_with_parent(parent: int) -> None:
    """SIGTERM to this process when its parent dies (Linux; elsewhere nothing)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            pr_set_pdeathsig = 1
            ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
        if os.getppid() != parent:  # it died before the request above
            os.kill(os.getpid(), signal.SIGTERM)
