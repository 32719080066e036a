"""A replica's one decode loop, fed by all the calls it has in flight (docs/design.md §4).

Ray Data hands a replica several blocks of rows at once; their requests wait in one queue
that a single `spot.decode.stream`, running in a thread of its own, takes from whenever a
place in its batch is free. So the batch stays full across calls until the input runs out:
only the job's own last requests drain. Each call gets its own rows back, as they finish.

What a failed forward costs (the loop's exception loses the batch's state, never the
requests: their tokens depend on nothing but themselves, so decoding them again from the
start gives the same tokens):
- every failure is logged with its traceback (on stderr, which reaches the run's log) and
  counted by its first line (`failures`, and `on_failure`);
- out of memory halves this replica's batch for the rest of its life, and says so; the
  batch's requests wait again at the front of the queue;
- any other failure decodes the batch's requests again in halves, and halves of halves, so
  a request that fails even alone becomes an error row and the others are kept;
- when more than `max_error_rate` of the last ERROR_WINDOW rows failed (once MIN_ROWS_RATED
  rows are in the window), every call fails with `TooManyFailuresError`, naming the most common
  error and example rows: the job stops, and what was written is kept.

Draining (a signal to the run): `drain` stops admitting requests (those waiting are let go
unfinished), the active ones finish; `abandon` lets go of them too at the grace deadline.
A call whose requests are all finished or let go returns; rows let go are not written, and
a resubmit generates them.
"""

from __future__ import annotations

import gc
import sys
import threading
import traceback
from collections import Counter, deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Protocol

import torch

from pipeline.job import ERROR_WINDOW
from spot.config import DecodingConfig
from spot.decode import Drafter, Request, Result, Trace, stream
from spot.target import PrefixStore, Target

MIN_ROWS_RATED = 8  # rows the window must hold before the rate can stop the job
TRACEBACKS_PER_ERROR = 3  # a failure repeated more often is logged in one line

Outcome = Result | str | None  # a result, why its request failed, or None: let go unfinished


class TooManyFailuresError(RuntimeError):
    """Too many of a replica's recent rows failed in generation: the job stops."""


class Call:
    """The requests of one replica call, each resolved once; `done` when all are (or fails
    with the replica's `TooManyFailuresError`). `on_outcome(position, outcome)` sees each
    resolution as it happens, in the thread that made it."""

    def __init__(self, size: int, on_outcome: Callable[[int, Outcome], None] | None = None):
        self.outcomes: list[Outcome] = [None] * size
        self.resolved = [False] * size
        self.left = size
        self.on_outcome = on_outcome
        self.done: Future[None] = Future()
        self._lock = threading.Lock()
        if size == 0:
            self.done.set_result(None)

    def resolve(self, position: int, outcome: Outcome) -> bool:
        """Record a request's outcome; False if it was resolved already."""
        with self._lock:
            if self.resolved[position] or self.done.done():
                return False
            self.resolved[position] = True
            self.outcomes[position] = outcome
            self.left -= 1
            last = self.left == 0
        if self.on_outcome is not None:
            self.on_outcome(position, outcome)
        if last:
            self.done.set_result(None)
        return True

    def fail(self, error: BaseException) -> None:
        with self._lock:
            if not self.done.done():
                self.done.set_exception(error)


@dataclass(eq=False)
class Pending:
    """One request of a call, waiting or decoding."""

    request: Request
    name: str  # its row, as error messages name it
    call: Call
    position: int  # its row in the call

    @property
    def resolved(self) -> bool:
        return self.call.resolved[self.position]


class RecordingTrace(Trace, Protocol):
    """A stream's trace that records rows: the noise key of each of its request indices."""

    keys: dict[int, int]


class Recording(Protocol):
    """What records a replica's rows (`pipeline.learning.RowRecording`)."""

    def recorder(self) -> RecordingTrace | None:
        """A trace for the next stream (None: recording nothing)."""
        ...

    def finished(self, trace: RecordingTrace, key: int) -> None:
        """The request with this noise key finished in the stream `trace` records."""
        ...


@dataclass(frozen=True)
class _Rated:
    """A finished row, as the error rate counts it."""

    name: str
    error: str | None


class Decoder:
    """One replica's decode loop (see the module docstring). `submit` from any thread."""

    def __init__(
        self,
        target: Target,
        config: DecodingConfig,
        drafter: Drafter | None,
        *,
        max_active: int,
        prefix_cache: PrefixStore | None = None,
        max_error_rate: float = 1.0,
        log: Callable[[str], None] | None = None,
        recording: Recording | None = None,
    ):
        """recording: records the rows each stream finishes (a job that learns its drafter;
        the trace of the forwards the loop takes, no forward of its own)."""
        self.target = target
        self.config = config
        self.drafter = drafter
        self.max_active = max_active
        self.prefix_cache = prefix_cache
        self.max_error_rate = max_error_rate
        self.log = log or _stderr
        self.recording = recording
        self._trace: RecordingTrace | None = None  # the current stream's
        self.failures: Counter[str] = Counter()  # failed batches by their error's first line
        self.on_failure: Callable[[str], None] | None = None
        self._cond = threading.Condition()
        self._waiting: deque[Pending] = deque()
        self._in_flight: dict[int, Pending] = {}  # by index in the current stream
        self._taken = 0  # requests the current stream took
        self._calls: set[Call] = set()  # calls with requests not yet resolved
        self._rated: deque[_Rated] = deque(maxlen=ERROR_WINDOW)
        self._draining = False
        self._abandoned = False
        self._fatal: TooManyFailuresError | None = None
        self._thread: threading.Thread | None = None

    # -- what calls and the replica use ------------------------------------------------------
    def submit(self, pending: list[Pending]) -> None:
        """Queue requests (in this order, after those waiting); a draining decoder lets them
        go at once, a failed one fails their calls."""
        calls = {p.call for p in pending}
        with self._cond:
            fatal, let_go = self._fatal, self._draining
            if not (fatal or let_go):
                self._calls |= {c for c in calls if not c.done.done()}
                self._waiting.extend(pending)
                self._cond.notify_all()
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, daemon=True, name="decode")
                    self._thread.start()
        if fatal is not None:
            for call in calls:
                call.fail(fatal)
        elif let_go:
            for p in pending:
                p.call.resolve(p.position, None)

    def drain(self) -> None:
        """Admit nothing more: waiting requests are let go, active ones finish."""
        with self._cond:
            self._draining = True
            let_go = list(self._waiting)
            self._waiting.clear()
            self._cond.notify_all()
        for p in let_go:
            p.call.resolve(p.position, None)

    def abandon(self) -> None:
        """Let go of every request not finished yet (the grace period is over)."""
        with self._cond:
            self._draining = self._abandoned = True
            calls = list(self._calls)
            self._waiting.clear()
            self._cond.notify_all()
        for call in calls:
            for position in range(len(call.resolved)):
                call.resolve(position, None)

    def unfinished(self) -> int:
        """Requests this replica holds that are not resolved yet."""
        with self._cond:
            self._calls = {call for call in self._calls if not call.done.done()}
            return sum(call.left for call in self._calls)

    # -- the decode thread ---------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stopped():
            with self._cond:
                while not self._waiting and not self._draining and self._fatal is None:
                    self._cond.wait()
                if self._stopped() or (self._draining and not self._waiting):
                    return
            self._stream()

    def _stopped(self) -> bool:
        return self._abandoned or self._fatal is not None

    def _stream(self) -> None:
        """One stream over the queue, until the queue ends (a drain) or a forward fails."""
        with self._cond:
            self._in_flight, self._taken = {}, 0
        # a failed stream's records are dropped with it: its requests decode again
        trace = self._trace = None if self.recording is None else self.recording.recorder()
        try:
            for index, result in self._decode(self._source(), self.max_active, trace):
                with self._cond:
                    pending = self._in_flight.pop(index)
                if trace is not None:
                    self.recording.finished(trace, pending.request.key)
                self._resolve(pending, result)
                if self._stopped():
                    return
        except Exception as error:
            with self._cond:
                suspects = [p for p in self._in_flight.values() if not p.resolved]
                self._in_flight = {}
            self._failed(error, suspects)

    def _decode(
        self, requests, max_active: int, trace: Trace | None = None
    ) -> Iterator[tuple[int, Result]]:
        return stream(
            self.target,
            requests,
            self.config,
            self.drafter,
            trace,
            max_active=max_active,
            prefix_cache=self.prefix_cache,
        )

    def _source(self) -> Iterator[Request | None]:
        """The queue as the stream's source: None when nothing waits but requests decode;
        waits while nothing decodes; ends when draining and nothing waits."""
        while True:
            with self._cond:
                while not (self._waiting or self._in_flight or self._draining or self._stopped()):
                    self._cond.wait()
                if self._stopped() or (self._draining and not self._waiting):
                    return
                pending = self._waiting.popleft() if self._waiting else None
                if pending is not None:
                    self._in_flight[self._taken] = pending
                    if self._trace is not None:
                        self._trace.keys[self._taken] = pending.request.key
                    self._taken += 1
            yield None if pending is None else pending.request

    def _resolve(self, pending: Pending, outcome: Result | str) -> None:
        if not pending.call.resolve(pending.position, outcome):
            return
        error = outcome if isinstance(outcome, str) else None
        with self._cond:
            if pending.call.done.done():
                self._calls.discard(pending.call)
            self._rated.append(_Rated(pending.name, error))
        if error is not None:
            self._check_error_rate()

    # -- failures ------------------------------------------------------------------------------
    def _failed(self, error: Exception, suspects: list[Pending]) -> None:
        """The stream's forward failed with these requests in its batch."""
        self._record(error, len(suspects))
        if not suspects:
            return
        if _out_of_memory(error) and len(suspects) > 1:
            self._halve(len(suspects))
            with self._cond:
                self._waiting.extendleft(reversed(suspects))
            return
        self._isolate(suspects)

    def _halve(self, batch: int) -> None:
        before = self.max_active
        self.max_active = max(1, min(self.max_active, batch) // 2)
        self.log(
            f"out of memory decoding {batch} requests at once: this replica now decodes at "
            f"most {self.max_active} at once (resources.batch_size was {before})"
        )
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def _isolate(self, group: list[Pending]) -> None:
        """Decode a failed batch's requests again, in halves down to one request: only a
        request that fails alone becomes an error row."""
        middle = len(group) // 2
        halves = [group] if len(group) == 1 else [group[:middle], group[middle:]]
        for half in halves:
            if self._stopped():
                return
            try:
                for index, result in self._decode(list(p.request for p in half), len(half)):
                    self._resolve(half[index], result)
                    if self._stopped():
                        return
            except Exception as error:
                self._record(error, len(half))
                left = [p for p in half if not p.resolved]
                if len(half) == 1:
                    for p in left:
                        self._resolve(p, f"generation failed: {_first_line(error)}")
                else:
                    if _out_of_memory(error) and len(left) > 1:
                        self._halve(len(left))
                    self._isolate(left)

    def _record(self, error: Exception, batch: int) -> None:
        line = _first_line(error)
        self.failures[line] += 1
        seen = self.failures[line]
        header = f"generation failed for a batch of {batch} request(s): {line}"
        if seen <= TRACEBACKS_PER_ERROR:
            trace = "".join(traceback.format_exception(error)).rstrip()
            self.log(f"{header}\n{trace}")
        else:
            self.log(f"{header} (failure {seen} of this kind; traceback as above)")
        if self.on_failure is not None:
            self.on_failure(line)

    def _check_error_rate(self) -> None:
        with self._cond:
            rated = list(self._rated)
        failed = [r for r in rated if r.error is not None]
        if len(rated) < MIN_ROWS_RATED or len(failed) <= self.max_error_rate * len(rated):
            return
        common, count = Counter(r.error for r in failed).most_common(1)[0]
        examples = [r.name for r in failed if r.error == common][:3]
        fatal = TooManyFailuresError(
            f"{len(failed)} of the last {len(rated)} rows failed in generation, more than "
            f"resources.max_error_rate {self.max_error_rate:g}; most common ({count} rows, e.g. "
            f"{', '.join(examples)}): {common.removeprefix('generation failed: ')}"
        )
        with self._cond:
            if self._fatal is not None:
                return
            self._fatal = fatal
            calls = list(self._calls)
            self._waiting.clear()
            self._cond.notify_all()
        self.log(f"stopping the job: {fatal}")
        for call in calls:
            call.fail(fatal)


def _out_of_memory(error: BaseException) -> bool:
    """torch's out-of-memory errors (CUDA's among them), a MemoryError, or an allocator's
    RuntimeError saying so."""
    if isinstance(error, torch.OutOfMemoryError | MemoryError):
        return True
    text = str(error).lower()
    return isinstance(error, RuntimeError) and (
        "out of memory" in text or "can't allocate memory" in text
    )


def _first_line(error: BaseException) -> str:
    lines = [line for line in str(error).splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[0]}"[:300] if lines else type(error).__name__


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
