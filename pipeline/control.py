"""How a run stops on a signal, and what its replicas tell the driver besides progress.

SIGTERM (a scheduler, a preempted node), SIGINT (Ctrl-C) or SIGHUP while a run goes
(`SignalStop`, in the driver's main thread):
1. the driver tells the run's `RunControl` actor to drain, and says so in a line;
2. each replica (`ReplicaControl`, which polls that actor) admits no more rows: its waiting
   rows are let go, its active ones finish within `resources.grace_seconds`, after which they
   are let go too; each call returns the rows that finished (`pipeline.decoder`);
3. the driver waits until every replica holds no rows and every row they returned is written
   (the sink counts what it writes), at the latest WRITE_SECONDS after the grace period, then
   stops the run by raising `RunInterrupted` in its main thread;
4. the run records itself `interrupted` in summary.json, Ray stops (its temporary folder
   removed) and the command prints one line and exits 128 + the signal (143, 130).
A second signal stops at once, as does a signal before the pipeline runs; one that comes
after it ended is noted and the run finishes.

A signal sent to the command's process group would reach the embedded Ray's processes too
(they are the driver's children) and kill them before anything drains: `submit` runs the
driver in a session of its own (`pipeline.session.own_session`).
"""

from __future__ import annotations

import _thread
import contextlib
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import ray

SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)  # what drains a run
WRITE_SECONDS = 10.0  # after the grace period, for the last rows to be written
POLL_SECONDS = 0.25


def beside_the_driver(soft: bool = False) -> dict[str, Any]:
    """Actor options that place a run's own actor (its control, progress counter, learner)
    on the driver's node. Anywhere else it could land on a node that is lost, or is already
    lost and not yet marked dead (a resubmit right after a node loss), and take the run with
    it; `soft` lets an actor that needs CPUs go elsewhere when the driver's node has none."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    node = ray.get_runtime_context().get_node_id()
    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(node, soft=soft)}


class RunInterrupted(KeyboardInterrupt):
    """The run was stopped by a signal (like Ctrl-C's KeyboardInterrupt, which libraries
    clean up after); `summary` says what it kept, once the run has written its record."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
        self.exit_code = 128 + signum
        self.summary = ""


@ray.remote(num_cpus=0)
class RunControl:
    """The run's drain flag, the rows its replicas hold, return and write, and the batch
    failures they met."""

    def __init__(self) -> None:
        self.replicas: dict[int, int | None] = {}  # rows held, as reported since the drain
        self.since: float | None = None  # when the drain began
        self.grace = 0.0
        self.returned = 0  # rows the replicas' calls returned
        self.written = 0  # rows the sink wrote
        self.failures: Counter[str] = Counter()

    def register(self) -> int:
        replica = len(self.replicas)
        self.replicas[replica] = None
        return replica

    def drain(self, grace_seconds: float) -> None:
        if self.since is None:
            self.since, self.grace = time.monotonic(), grace_seconds
            self.replicas = dict.fromkeys(self.replicas)

    def seconds_left(self) -> float | None:
        """None while the run goes; once it drains, the grace period left."""
        if self.since is None:
            return None
        return max(0.0, self.grace - (time.monotonic() - self.since))

    def holding(self, replica: int, rows: int) -> None:
        if self.since is not None:
            self.replicas[replica] = rows

    def returned_rows(self, rows: int) -> None:
        self.returned += rows

    def written_rows(self, rows: int) -> None:
        self.written += rows

    def drained(self) -> bool:
        """Every replica holds nothing since the drain began, and what they returned is
        written."""
        if self.since is None or any(held != 0 for held in self.replicas.values()):
            return False
        return self.written >= self.returned

    def batch_failure(self, line: str) -> None:
        self.failures[line] += 1

    def batch_failures(self) -> dict[str, Any]:
        """summary.json's `runs[].batch_failures`."""
        return {"count": self.failures.total(), "by_error": dict(self.failures.most_common())}


class ReplicaControl:
    """A replica's side of the run's control: it reports batch failures and returned rows,
    and a thread of its own polls the drain flag and drains the engine's decode loop."""

    def __init__(self, control: ray.actor.ActorHandle, engine: Any):
        self.control = control
        self.engine = engine
        self.replica = ray.get(control.register.remote())
        engine.on_failure = lambda line: control.batch_failure.remote(line)
        threading.Thread(target=self._watch, daemon=True, name="drain-watch").start()

    async def returned(self, rows: int) -> None:
        """Count a call's rows before it returns them (so the driver waits for their write)."""
        await self.control.returned_rows.remote(rows)

    def _watch(self) -> None:
        deadline = None
        while True:
            time.sleep(POLL_SECONDS)
            try:
                left = ray.get(self.control.seconds_left.remote(), timeout=30)
            except ray.exceptions.RayActorError:
                return  # the run is over
            except (ray.exceptions.RayError, TimeoutError):
                continue
            if left is None:
                continue
            decoder = self.engine.decoder
            if deadline is None:
                deadline = time.monotonic() + left
                decoder.drain()
            if time.monotonic() >= deadline:
                decoder.abandon()
            self.control.holding.remote(self.replica, decoder.unfinished())


class SignalStop:
    """The driver's signal handling for one run (see the module docstring): `with stop:`
    from before Ray starts to after the summary is written; `reinstall()` after ray.init
    (which installs a handler of its own); `running(control, grace)` while the pipeline
    runs; `finishing()` once it ended."""

    def __init__(self, echo: Callable[[str], None], name: str):
        self.echo = echo
        self.name = name
        self.signum: int | None = None  # the first signal received
        self.control: ray.actor.ActorHandle | None = None
        self.grace = 0.0
        self._ready = False  # drained: the next signal in the main thread stops the run
        self._finished = False
        self._lock = threading.Lock()
        self._saved: dict[int, Any] = {}
        self._watcher: threading.Thread | None = None

    def __enter__(self) -> SignalStop:
        if threading.current_thread() is threading.main_thread():
            self._saved = {s: signal.getsignal(s) for s in SIGNALS}
            self.reinstall()
        return self

    def __exit__(self, *exc: Any) -> None:
        with self._lock:
            self._finished = True
        for s, handler in self._saved.items():
            signal.signal(s, handler)

    def reinstall(self) -> None:
        if self._saved:
            for s in SIGNALS:
                signal.signal(s, self._handle)

    @contextlib.contextmanager
    def running(self, control: ray.actor.ActorHandle, grace: float) -> Iterator[None]:
        self.control, self.grace = control, grace
        try:
            yield
        finally:
            with self._lock:
                self.control, self._finished = None, True
            if self._watcher is not None:  # before Ray stops: it calls the control actor
                self._watcher.join()

    def _handle(self, signum: int, frame: Any) -> None:
        with self._lock:
            first, self.signum = self.signum is None, self.signum or signum
            control, finished, ready = self.control, self._finished, self._ready
        if finished:
            return  # the pipeline ended: the run finishes and says what it kept
        if ready or not first or control is None:
            raise RunInterrupted(self.signum)
        name = signal.Signals(signum).name
        self.echo(
            f"[{self.name}] {name}: admitting no more rows; the replicas finish the rows they "
            f"are decoding (up to {self.grace:g} s), then what finished is written "
            "(a second signal stops at once)"
        )
        control.drain.remote(self.grace)
        self._watcher = threading.Thread(target=self._wait, args=(control,), daemon=True)
        self._watcher.start()

    def _wait(self, control: ray.actor.ActorHandle) -> None:
        """Until the replicas drained and their rows are written (or time is up), then stop
        the run in the main thread."""
        deadline = time.monotonic() + self.grace + WRITE_SECONDS
        while time.monotonic() < deadline and not self._finished:
            with contextlib.suppress(ray.exceptions.RayError, TimeoutError):
                if ray.get(control.drained.remote(), timeout=POLL_SECONDS * 4):
                    break
            time.sleep(POLL_SECONDS)
        with self._lock:
            if self._finished:
                return
            self._ready = True
            _thread.interrupt_main(self.signum)
