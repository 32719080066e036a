"""One writer per output (docs/design.md §4, One writer): the lease a submit holds on its
output folder while it runs, and the marker each run keeps there until its record is in
summary.json.

`OUT/lease.json` names its holder: the run's id, the command, user, host and process (with
the process's start, so that a reused pid is not taken for it) and a heartbeat the holder
writes every HEARTBEAT_SECONDS. A submit takes it before it changes anything in the output
(`--overwrite` included) and deletes it when it ends. Another submit finds it and is
refused, naming the holder, unless the holder is gone: on the same machine, its process no
longer exists; seen from another machine, its heartbeat is older than STALE_SECONDS. Such a
lease is taken over, with a message.

In a local (or NFS) folder a submit takes and releases the lease holding an exclusive lock
on `OUT/.lease.lock` (flock; NFS clients lock it on the server): it reads the lease, is
refused if a live holder has it, else writes its own (through a temporary name, renamed
over a gone holder's). Submits started together take turns, and exactly one finds no live
holder; the name is never missing while a live holder has it.

pyarrow's object-store file systems offer neither a lock nor a conditional write (Arrow's
S3 writes set ACL, Cache-Control, Content-Type, Content-Language and Expires only, not
`If-None-Match: *`), so there the lease is written when none is found, read back
after SETTLE_SECONDS and kept only if it still holds this run's id: two submits that both
find no lease within the same moment can both write it, and the later write wins; the
holder reads its lease at every heartbeat and stops when another run holds it.

`OUT/runs/<run id>.json` marks a run from its start until its record is in summary.json.
A marker that outlives its run (SIGKILL, a lost machine, a full disk) lets the next submit
record that run as `lost`, with what its parts hold (`summary.lost_run_record`).
"""

from __future__ import annotations

import contextlib
import fcntl
import getpass
import json
import os
import posixpath
import secrets
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from datetime import UTC, datetime
from typing import Any

import pyarrow.fs as pafs

from pipeline.job import JobError
from pipeline.output import RUNS_DIR, OutputDir, write_atomically

LEASE_FILE = "lease.json"
LOCK_FILE = ".lease.lock"  # local folders: held while the lease is taken or released
HEARTBEAT_SECONDS = 15.0
STALE_SECONDS = 120.0  # a heartbeat this old, seen from another machine: the holder is gone
SETTLE_SECONDS = 2.0  # object stores: how long a written lease must survive to be held
UNREADABLE = "(unreadable)"  # the run id of a lease file that is not a lease


class OutputHeld(JobError):
    """Another submit holds the output's lease."""


def new_run_id() -> str:
    """A run's id: its start (UTC) and a random suffix, sortable and unique."""
    return f"{datetime.now(UTC):%Y%m%dT%H%M%SZ}-{secrets.token_hex(3)}"


@dataclass(frozen=True)
class Holder:
    """Who holds a lease (the content of lease.json)."""

    run_id: str
    command: str
    user: str
    host: str
    pid: int
    process: str | None  # boot id / pid namespace / start tick of the process (Linux)
    started_at: str  # ISO 8601, UTC
    heartbeat: float  # Unix time of the last heartbeat

    @classmethod
    def this_process(cls, run_id: str, command: str) -> Holder:
        return cls(
            run_id=run_id,
            command=command,
            user=_user(),
            host=socket.gethostname(),
            pid=os.getpid(),
            process=_process_identity(os.getpid()),
            started_at=datetime.now(UTC).isoformat(timespec="seconds"),
            heartbeat=time.time(),
        )

    def describe(self) -> str:
        age = max(0.0, time.time() - self.heartbeat)
        return (
            f"{self.command} run {self.run_id} by {self.user} on {self.host} (pid {self.pid}), "
            f"started {self.started_at}, last heartbeat {age:.0f} s ago"
        )

    def gone(self, stale_after: float = STALE_SECONDS) -> str | None:
        """Why the holder is gone, or None while it may be running. A process of this
        machine (same host, boot and pid namespace) is asked directly; another's heartbeat
        must be older than `stale_after`."""
        if self.run_id == UNREADABLE:
            return "its lease file cannot be read"
        if self.host == socket.gethostname() and _same_kernel_view(self.process):
            if not _alive(self.pid, self.process):
                return f"its process {self.pid} no longer runs"
            return None
        age = time.time() - self.heartbeat
        if age > stale_after:
            return f"its last heartbeat is {age:.0f} s old (more than {stale_after:.0f} s)"
        return None


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return str(os.getuid())


def _boot_and_namespace() -> str | None:
    try:
        with open("/proc/sys/kernel/random/boot_id") as boot:
            return f"{boot.read().strip()}/{os.readlink('/proc/self/ns/pid')}"
    except OSError:
        return None


def _start_tick(pid: int) -> str | None:
    """The process's start, in clock ticks after boot (field 22 of /proc/PID/stat)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _process_identity(pid: int) -> str | None:
    kernel, tick = _boot_and_namespace(), _start_tick(pid)
    return None if kernel is None or tick is None else f"{kernel}/{tick}"


def _same_kernel_view(process: str | None) -> bool:
    """The holder's pid means the same process here: same boot, same pid namespace (or
    neither side knows)."""
    here = _boot_and_namespace()
    if process is None or here is None:
        return process is None and here is None
    return process.rsplit("/", 1)[0] == here


def _alive(pid: int, process: str | None) -> bool:
    if process is not None:
        return _process_identity(pid) == process
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def lease_path(output: OutputDir) -> str:
    return posixpath.join(output.root, LEASE_FILE)


def read_lease(output: OutputDir) -> Holder | None:
    """The lease's holder, None without a lease. A lease that cannot be read is held by
    nobody alive (its heartbeat 0)."""
    path = lease_path(output)
    try:
        with output.filesystem.open_input_stream(path) as stream:
            text = stream.read().decode()
    except FileNotFoundError:
        return None
    except OSError:
        if output.filesystem.get_file_info(path).type == pafs.FileType.NotFound:
            return None
        raise
    try:
        return Holder(**json.loads(text))
    except (ValueError, TypeError):
        return Holder(UNREADABLE, "?", "?", "?", 0, None, "?", 0.0)


def check_lease(output: OutputDir) -> str | None:
    """What `validate` says of the output's lease (reading only): raises OutputHeld while
    a live submit holds it; a line when a gone holder's lease awaits takeover."""
    holder = read_lease(output)
    if holder is None:
        return None
    reason = holder.gone()
    if reason is None:
        raise OutputHeld(_held(output, holder))
    return (
        f"output.path: its lease is held by {holder.describe()}; {reason}: a submit takes it over"
    )


def _held(output: OutputDir, holder: Holder) -> list[str]:
    return [
        f"output.path: {output.uri} is being written by another submit: {holder.describe()}",
        "one submit writes an output at a time: wait for it to end, or stop it; a lease "
        "whose holder is gone is taken over",
    ]


class Lease:
    """This process's lease on an output: `acquire` before anything is written, `release`
    at the end; a daemon thread heartbeats in between. `on_lost` is called (once, from
    that thread) if another run comes to hold the lease."""

    def __init__(
        self,
        output: OutputDir,
        command: str = "submit",
        run_id: str | None = None,
        on_lost: Callable[[str], None] | None = None,
    ):
        self.output = output
        self.holder = Holder.this_process(run_id or new_run_id(), command)
        self.on_lost = on_lost
        self.local = isinstance(output.filesystem, pafs.LocalFileSystem)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._marker: dict[str, Any] | None = None

    @property
    def run_id(self) -> str:
        return self.holder.run_id

    def acquire(self) -> str | None:
        """Take the lease, or raise OutputHeld naming its holder. Returns a line to print
        when a gone holder's lease was taken over."""
        try:
            return self._acquire()
        except OSError as error:
            raise JobError([f"output.path: cannot take its lease: {error}"]) from error

    def _acquire(self) -> str | None:
        self.output.filesystem.create_dir(self.output.root, recursive=True)
        if self.local:
            with self._locked():
                taken = self._take_over(read_lease(self.output))
                self._write(lease_path(self.output), asdict(self.holder))
            self._start_heartbeat()
            return taken
        taken = None
        for _ in range(5):
            if self._create():
                self._start_heartbeat()
                return taken
            holder = read_lease(self.output)
            if holder is None:
                continue  # released in between: try again
            taken = self._take_over(holder)
            self._remove(holder)
        raise OutputHeld(
            [f"output.path: {self.output.uri}: other submits are taking its lease; try again"]
        )

    def _take_over(self, holder: Holder | None) -> str | None:
        """Refuse a live holder; the line saying a gone one's lease is taken over."""
        if holder is None:
            return None
        reason = holder.gone()
        if reason is None:
            raise OutputHeld(_held(self.output, holder))
        return f"took over the output's lease from {holder.describe()}: {reason}"

    @contextlib.contextmanager
    def _locked(self):
        """The output's lease lock (local folders), held for the `with` block."""
        with open(posixpath.join(self.output.root, LOCK_FILE), "a") as lock:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock.fileno(), fcntl.LOCK_UN)

    def _create(self) -> bool:
        """Object stores: write lease.json holding this process unless one exists, and keep
        it if it still holds this run after SETTLE_SECONDS."""
        path = lease_path(self.output)
        if self.output.filesystem.get_file_info(path).type != pafs.FileType.NotFound:
            return False
        self._write(path, asdict(self.holder))
        time.sleep(SETTLE_SECONDS)
        holder = read_lease(self.output)
        return holder is not None and holder.run_id == self.run_id

    def _remove(self, stale: Holder) -> None:
        """Object stores: remove the lease of `stale`, if it still holds it."""
        holder = read_lease(self.output)
        if holder is not None and holder.run_id == stale.run_id:
            self.output.filesystem.delete_file(lease_path(self.output))

    def _start_heartbeat(self) -> None:
        self._thread = threading.Thread(target=self._beat, name="lease-heartbeat", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_SECONDS):
            try:
                holder = read_lease(self.output)
                if holder is None or holder.run_id != self.run_id:
                    if self.on_lost is not None:
                        other = "nobody" if holder is None else holder.describe()
                        self.on_lost(f"this run lost the output's lease (now held by {other})")
                    return
                self.holder = replace(self.holder, heartbeat=time.time())
                self._write(lease_path(self.output), asdict(self.holder))
                if self._marker is not None:
                    self._marker["last_seen"] = self.holder.heartbeat
                    self._write(marker_path(self.output, self.run_id), self._marker)
            except OSError:
                continue  # a full disk, a slow store: the next heartbeat tries again

    def _write(self, path: str, content: dict[str, Any]) -> None:
        text = json.dumps(content, indent=2).encode()
        write_atomically(self.output.filesystem, path, lambda f: f.write(text))

    def mark_run(self, replicas: int, rows_retried: int = 0) -> None:
        """Write this run's marker (`runs/<run id>.json`), kept fresh by the heartbeat."""
        self._marker = {
            "run_id": self.run_id,
            "started_at": self.holder.started_at,
            "host": self.holder.host,
            "pid": self.holder.pid,
            "replicas": replicas,
            "rows_retried": rows_retried,
            "last_seen": time.time(),
        }
        self._write(marker_path(self.output, self.run_id), self._marker)

    def release(self, recorded: bool) -> None:
        """Stop the heartbeat; remove this run's marker when `recorded` (its record is in
        summary.json), and the lease if it is still this run's."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        with contextlib.suppress(OSError):
            if recorded and self._marker is not None:
                self.output.filesystem.delete_file(marker_path(self.output, self.run_id))
            with self._locked() if self.local else contextlib.nullcontext():
                holder = read_lease(self.output)
                if holder is not None and holder.run_id == self.run_id:
                    self.output.filesystem.delete_file(lease_path(self.output))


def marker_path(output: OutputDir, run_id: str) -> str:
    return posixpath.join(output.root, RUNS_DIR, f"{run_id}.json")


def read_markers(output: OutputDir) -> list[dict[str, Any]]:
    """The markers of runs not yet recorded in summary.json (or whose record is, but whose
    marker could not be removed), oldest first."""
    folder = posixpath.join(output.root, RUNS_DIR)
    if output.filesystem.get_file_info(folder).type != pafs.FileType.Directory:
        return []
    markers = []
    for info in output.filesystem.get_file_info(pafs.FileSelector(folder)):
        if info.type != pafs.FileType.File or not info.base_name.endswith(".json"):
            continue
        if info.base_name.startswith("."):
            continue
        with output.filesystem.open_input_stream(info.path) as stream:
            try:
                markers.append(json.loads(stream.read().decode()))
            except ValueError:
                continue
    return sorted(markers, key=lambda m: m.get("started_at", ""))


def remove_marker(output: OutputDir, run_id: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        output.filesystem.delete_file(marker_path(output, run_id))
