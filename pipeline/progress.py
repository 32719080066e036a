"""Live progress of a run, a generation batch at a time.

Each replica reports the rows of the block it is working on as its engine finishes a batch
of them (`ProgressCounter.report`, a call that does not wait); the driver reads the totals
twice a second and shows them: a bar on a terminal, else a line every `interval` seconds.
Nothing is read back from the output. A block's last report is its rows as written, and a
block retried after its replica died replaces its earlier counts instead of adding to them,
so the totals end exact; while a block is under way its tokens are counted to the EOS,
before any stop string cuts the completion.

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
    second report: start-up is not throughput)."""

    rows: int = 0
    errors: int = 0
    tokens: int = 0
    nfe: int = 0
    tokens_per_second: float | None = None
    rows_per_second: float | None = None


@ray.remote(num_cpus=0)
class ProgressCounter:
    """Totals of the rows the replicas have finished, by the block (`call`) they belong to."""

    def __init__(self) -> None:
        self.calls: dict[str, Counts] = {}
        self.totals: Counts = (0, 0, 0, 0)
        self.first: tuple[float, Counts] | None = None  # when the first batch was reported

    def report(self, call: str, counts: Counts) -> None:
        """`counts` of the rows of block `call` so far (they replace its earlier ones)."""
        before = self.calls.get(call, (0, 0, 0, 0))
        self.calls[call] = counts
        self.totals = tuple(t + n - b for t, n, b in zip(self.totals, counts, before))
        if self.first is None:
            self.first = (time.monotonic(), self.totals)

    def read(self) -> Progress:
        if self.first is None:
            return Progress(*self.totals)
        seconds = time.monotonic() - self.first[0]
        rows, _, tokens, _ = self.first[1]
        if seconds <= 0 or self.totals[0] == rows:
            return Progress(*self.totals)
        rates = (self.totals[2] - tokens) / seconds, (self.totals[0] - rows) / seconds
        return Progress(*self.totals, *rates)


class ProgressPrinter:
    """Shows the counter's totals while a run goes (`with printer:`): a bar drawn on `bar`
    (a terminal) when given, else a line through `echo` every `interval` seconds. Keeps samples
    `[seconds, rows, tokens, nfe]` of them for the report (at most MAX_SAMPLES: when full,
    every other one is dropped)."""

    POLL_SECONDS = 0.5
    MAX_SAMPLES = 512

    def __init__(
        self, name: str, total_rows: int, echo: Echo, interval: float, bar: TextIO | None = None
    ):
        self.name = name
        self.total_rows = total_rows
        self.echo = echo
        self.interval = interval
        self.bar = bar
        self.start = time.perf_counter()
        self.counter: Any = None  # the ProgressCounter actor, made on entering
        self.progress = Progress()
        self.samples: list[list[float]] = []
        self._shown = self.start  # when the last line was printed
        self._bar: Any = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> ProgressPrinter:
        self.counter = ProgressCounter.remote()
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

    def poll(self, final: bool = False) -> None:
        try:
            progress = ray.get(self.counter.read.remote(), timeout=10)
        except (ray.exceptions.RayError, TimeoutError):
            progress = self.progress  # the counter is busy or gone: show what was read last
        elapsed = time.perf_counter() - self.start
        if progress.rows != self.progress.rows or final or not self.samples:
            self._sample([elapsed, progress.rows, progress.tokens, progress.nfe])
        self.progress = progress
        if self._bar is not None:
            self._bar.n = min(progress.rows, self.total_rows)
            self._bar.set_postfix_str(self._status(progress), refresh=False)
            self._bar.refresh()
        elif final or elapsed - (self._shown - self.start) >= self.interval:
            self._shown = time.perf_counter()
            self.echo(
                f"[progress] {progress.rows}/{self.total_rows} rows ({progress.errors} errors)"
                f" | {self._status(progress, errors=False)} | elapsed {elapsed:.0f}s"
            )

    def _status(self, progress: Progress, errors: bool = True) -> str:
        rate = progress.tokens_per_second
        generated = progress.rows - progress.errors
        parts = [f"{progress.errors} errors"] if errors else []
        parts.append("- tok/s" if rate is None else f"{rate:.1f} tok/s")
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
