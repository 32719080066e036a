"""A run's log file, so that the terminal shows the project's own lines and nothing else.

While a job runs, what Ray and the libraries print (Ray's and Ray Data's log lines, the C++
lines of Ray's core worker, what the replicas print, library warnings) goes to
`OUT/logs/<command>-<UTC time>.log` instead of the terminal, together with the project's
own lines and, when the run fails, the full traceback; the terminal shows one message that
names the file. An output on object storage gets its log copied there when the run ends
(the file is written locally first).
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import sys
import tempfile
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import TextIO

import pyarrow.fs as pafs

from pipeline.output import OutputDir

LOG_DIR = "logs"


@contextlib.contextmanager
def run_log(output: OutputDir, command: str) -> Iterator[tuple[Path, TextIO]]:
    """(log path, log file) while everything printed to stdout or stderr (file descriptor
    2, so the C++ lines too) goes to that file; write to the terminal through streams taken
    before entering."""
    name = f"{command}-{datetime.now(UTC):%Y%m%d-%H%M%S}.log"
    local = isinstance(output.filesystem, pafs.LocalFileSystem)
    folder = Path(output.root, LOG_DIR) if local else Path(tempfile.gettempdir(), "spot-logs")
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    sys.stdout.flush()
    sys.stderr.flush()
    log = TolerantLog(open(path, "a", buffering=1))  # noqa: SIM115 (closed below)
    saved = os.dup(2)
    os.dup2(log.fileno(), 2)
    try:
        with contextlib.redirect_stdout(log):
            yield path, log
    finally:
        with contextlib.suppress(OSError):
            sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        log.close()
    if not local:
        remote = f"{output.root}/{LOG_DIR}/{name}"
        with contextlib.suppress(OSError):
            output.filesystem.create_dir(f"{output.root}/{LOG_DIR}")
            with output.filesystem.open_output_stream(remote) as stream:
                stream.write(path.read_bytes())


class TolerantLog(io.TextIOBase):
    """A log file whose writes never raise: on a full disk (or a folder that became
    read-only) the run goes on and ends with its own message; the log keeps what fit."""

    def __init__(self, file: TextIO):
        self.file = file

    def write(self, text: str) -> int:
        with contextlib.suppress(OSError):
            self.file.write(text)
        return len(text)

    def flush(self) -> None:
        with contextlib.suppress(OSError):
            self.file.flush()

    def fileno(self) -> int:
        return self.file.fileno()

    def close(self) -> None:
        with contextlib.suppress(OSError):  # the file is closed even when its flush fails
            self.file.close()


def failure_reason(error: BaseException) -> str:
    """What went wrong, in one line. A replica's exception reaches the driver wrapped by Ray
    (a RayTaskError holding it, or an ActorDiedError holding only its traceback's text,
    itself raised from Ray Data's SystemException): the innermost exception that is not
    Ray's, else the last `Type: message` line of a Ray error's remote traceback that is not
    a Ray exception's (Ray Data wraps a replica's exception in its UserCodeException)."""
    chain: list[BaseException] = []
    while error is not None and error not in chain:
        chain.append(error)
        error = getattr(error, "cause", None) or error.__cause__
    own = [e for e in chain if not type(e).__module__.startswith("ray.")]
    if own:
        return _one_line(type(own[-1]).__name__, str(own[-1]))
    for wrapped in chain:
        for line in reversed(str(wrapped).splitlines()):
            raised = _RAISED.match(line.strip())
            if raised and not (raised["module"] or "").startswith("ray."):
                return _one_line(raised["type"], raised["message"])
    return _one_line(type(chain[0]).__name__, str(chain[0]))


# the last line of a Python traceback: `package.module.SomeError: message`
_RAISED = re.compile(
    r"^(?P<module>(?:\w+\.)*)(?P<type>\w*(?:Error|Exception|Exit))(?:: (?P<message>.*))?$"
)


def _one_line(kind: str, message: str | None) -> str:
    lines = [line for line in (message or "").splitlines() if line.strip()]
    return f"{kind}: {lines[0]}"[:400] if lines else kind
