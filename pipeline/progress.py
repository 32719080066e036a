"""Live progress of a run: its start-up phases, then a generation batch at a time.

Before any row, a run starts Ray and then its replicas load the model (tens of seconds on
a small machine): each replica reports when its engine is built (`ProgressCounter.ready`),
and the driver says so, so the start-up reads as phases ("starting Ray", "loading the model
on 2 replicas: 1/2 ready") instead of rows that do not move. Then each replica reports the
rows of the block it is working on as its engine finishes a batch of them
(`ProgressCounter.report`, a call that does not wait); the driver reads the totals twice a
second and shows them: a bar on a terminal, else a line every `interval` seconds. Nothing
is read back from the output. A block's last report is its rows as written, and a block
retried after its replica died replaces its earlier counts instead of adding to them, so the
totals end exact; while a block is under way its tokens are counted to the EOS, before any
stop string cuts the completion.

Two rates, named where they are shown: "tok/s decoding" is the tokens generated since the
first batch finished over the seconds since then (what the replicas sustain, from which the
ETA comes); a run's own tokens/s, in its final line, summary.json and the report, is its
generated tokens over its whole wall time, start-up included. The run's last progress line
and its final line show the same decoding rate.

This module imports nothing heavy: the counter is a Ray actor of its own.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TextIO

import pyarrow as pa
import pyarrow.compute as pc
import ray

from pipeline.control import beside_the_driver

Counts = tuple[int, int, int, int]  # rows, errors, generated tokens, target forwards (NFE)
Echo = Callable[[str], None]


def table_counts(table: pa.Table) -> Counts:
    """The counts of output rows as they are written."""
    errors = table.num_rows - table.column("error").null_count
    tokens = pc.sum(table.column("num_generated_tokens")).as_py() or 0
    return table.num_rows, errors, tokens, pc.sum(table.column("nfe")).as_py() or 0


@dataclass(frozen=True)
class Progress:
    """The replicas' totals, and the rates since the first batch finished (None before a
    second report: start-up is not throughput); the replicas whose engine is built, and the
    longest any of them took to build it."""

    rows: int = 0
    errors: int = 0
    tokens: int = 0
    nfe: int = 0
    tokens_per_second: float | None = None  # decoding: since the first batch finished
    rows_per_second: float | None = None
    replicas_ready: int = 0
    load_seconds: float | None = None
    generating_seconds: float | None = None  # the first replica ready to the last report


@ray.remote(num_cpus=0)
class ProgressCounter:
    """Totals of the rows the replicas have finished, by the block (`call`) they belong to,
    and which replicas have their engine built."""

    def __init__(self) -> None:
        self.calls: dict[str, Counts] = {}
        self.totals: Counts = (0, 0, 0, 0)
        self.first: tuple[float, Counts] | None = None  # when the first batch was reported
        self.loaded: dict[str, float] = {}  # replica (actor id): seconds its engine took
        self.ready_at: float | None = None  # when the first replica's engine was built
        self.reported_at: float | None = None  # when the last batch was reported

    def ready(self, replica: str, seconds: float) -> None:
        """Replica `replica` built its engine in `seconds` (a restarted one reports again,
        under the same actor id: counted once)."""
        self.loaded[replica] = seconds
        if self.ready_at is None:
            self.ready_at = time.monotonic()

    def report(self, call: str, counts: Counts) -> None:
        """`counts` of the rows of block `call` so far (they replace its earlier ones)."""
        before = self.calls.get(call, (0, 0, 0, 0))
        self.calls[call] = counts
        self.totals = tuple(t + n - b for t, n, b in zip(self.totals, counts, before))
        self.reported_at = time.monotonic()
        if self.first is None:
            self.first = (time.monotonic(), self.totals)

    def read(self) -> Progress:
        loaded: dict[str, Any] = {"replicas_ready": len(self.loaded)}
        loaded["load_seconds"] = max(self.loaded.values()) if self.loaded else None
        if self.ready_at is not None and self.reported_at is not None:
            loaded["generating_seconds"] = max(0.0, self.reported_at - self.ready_at)
        if self.first is None:
            return Progress(*self.totals, **loaded)
        seconds = time.monotonic() - self.first[0]
        rows, _, tokens, _ = self.first[1]
        if seconds <= 0 or self.totals[0] == rows:
            return Progress(*self.totals, **loaded)
        rates = (self.totals[2] - tokens) / seconds, (self.totals[0] - rows) / seconds
        return Progress(*self.totals, *rates, **loaded)


class ProgressPrinter:
    """Shows a run's start-up phases and then the counter's totals while it goes (`with
    printer:`, entered once Ray is up): a bar drawn on `bar` (a terminal) when given, else a
    line through `echo` every `interval` seconds; the phases as lines when they happen. Keeps
    samples `[seconds, rows, tokens, nfe]` of the totals for the report (at most MAX_SAMPLES:
    when full, every other one is dropped), and `phases`: seconds from its start to each
    phase reached."""

    POLL_SECONDS = 0.5
    MAX_SAMPLES = 512

    def __init__(
        self,
        name: str,
        total_rows: int,
        echo: Echo,
        interval: float,
        bar: TextIO | None = None,
        replicas: int = 1,
    ):
        self.name = name
        self.total_rows = total_rows
        self.echo = echo
        self.interval = interval
        self.bar = bar
        self.replicas = replicas
        self.start = time.perf_counter()
        self.counter: Any = None  # the ProgressCounter actor, made on entering
        self.progress = Progress()
        self.samples: list[list[float]] = []
        self.phases: dict[str, float] = {}  # ray, replicas_ready, first_rows: seconds
        self._shown = self.start  # when the last line was printed
        self._bar: Any = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    @property
    def decode_tokens_per_second(self) -> float | None:
        """The decoding rate last read (None before two batches were reported)."""
        return self.progress.tokens_per_second

    @property
    def generating_seconds(self) -> float | None:
        """From the first replica's engine built to the last batch reported, as last read
        (timed by the counter itself, not the driver's polls)."""
        return self.progress.generating_seconds

    def starting_ray(self) -> None:
        """Say that Ray is starting (or being connected to): the first phase."""
        self.echo(f"[{self.name}] starting Ray")

    def __enter__(self) -> ProgressPrinter:
        self.counter = ProgressCounter.options(**beside_the_driver()).remote()
        self.phases["ray"] = self._elapsed()
        replicas = f"{self.replicas} replica" + ("" if self.replicas == 1 else "s")
        self._event(
            f"[{self.name}] Ray ready after {self.phases['ray']:.1f} s; loading the model on "
            f"{replicas}"
        )
        if self.bar is not None:
            from tqdm import tqdm

            self._bar = tqdm(
                total=self.total_rows,
                file=self.bar,
                desc=f"[{self.name}]",
                unit="row",
                bar_format="{desc} {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} rows "
                "[{elapsed}{postfix}]",
                dynamic_ncols=True,
            )
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.poll(final=True)
        if self._bar is not None:
            self._bar.close()
        ray.kill(self.counter)

    def _loop(self) -> None:
        while not self._stop.wait(self.POLL_SECONDS):
            self.poll()

    def _elapsed(self) -> float:
        return time.perf_counter() - self.start

    def _event(self, line: str) -> None:
        """A phase reached: a line of its own, above the bar when one is drawn."""
        if self._bar is None:
            self.echo(line)
            return
        with self._bar.external_write_mode():
            self.echo(line)

    def poll(self, final: bool = False) -> None:
        try:
            progress = ray.get(self.counter.read.remote(), timeout=10)
        except (ray.exceptions.RayError, TimeoutError):
            progress = self.progress  # the counter is busy or gone: show what was read last
        elapsed = self._elapsed()
        self._phases(progress, elapsed)
        if progress.rows != self.progress.rows or final or not self.samples:
            self._sample([elapsed, progress.rows, progress.tokens, progress.nfe])
        self.progress = progress
        if self._bar is not None:
            self._bar.n = min(progress.rows, self.total_rows)
            self._bar.set_postfix_str(self._status(progress), refresh=False)
            self._bar.refresh()
        elif final or elapsed - (self._shown - self.start) >= self.interval:
            self._shown = time.perf_counter()
            errors = f" ({progress.errors} errors)" if progress.rows else ""
            self.echo(
                f"[progress] {progress.rows}/{self.total_rows} rows{errors}"
                f" | {self._status(progress, errors=False)} | elapsed {elapsed:.0f}s"
            )

    def _phases(self, progress: Progress, elapsed: float) -> None:
        """Lines for the replicas that became ready since the last read, and the phases'
        times."""
        ready, before = progress.replicas_ready, self.progress.replicas_ready
        if ready > before and "replicas_ready" not in self.phases:
            loaded = f"{progress.load_seconds:.1f} s" if progress.load_seconds else "-"
            line = f"[{self.name}] model loaded on {ready}/{self.replicas} replicas ({loaded})"
            if ready >= self.replicas:
                self.phases["replicas_ready"] = elapsed
                line += f"; generating {self.total_rows} rows"
            self._event(line)
        if progress.rows and "first_rows" not in self.phases:
            self.phases["first_rows"] = elapsed

    def _status(self, progress: Progress, errors: bool = True) -> str:
        if not progress.rows and progress.replicas_ready < self.replicas:
            return f"loading the model: {progress.replicas_ready}/{self.replicas} replicas ready"
        if not progress.rows:
            return "first batch decoding"
        rate = progress.tokens_per_second
        generated = progress.rows - progress.errors
        parts = [f"{progress.errors} errors"] if errors else []
        parts.append("- tok/s decoding" if rate is None else f"{rate:.1f} tok/s decoding")
        parts.append(f"mean NFE {progress.nfe / generated:.1f}" if generated else "mean NFE -")
        left = self.total_rows - progress.rows
        if left <= 0:
            parts.append("ETA 0s")
        elif progress.rows_per_second:
            parts.append(f"ETA {_duration(left / progress.rows_per_second)}")
        else:
            parts.append("ETA -")
        return " | ".join(parts)

    def _sample(self, sample: list[float]) -> None:
        self.samples.append(sample)
        if len(self.samples) > self.MAX_SAMPLES:
            self.samples = [*self.samples[:-1:2], self.samples[-1]]


def _duration(seconds: float) -> str:
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
