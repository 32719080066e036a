"""Live progress: the start-up phases (Ray, the replicas loading the model), then replicas
report a block's rows a generation batch at a time to a Ray actor; a block reported again
(its replica died and it was retried) replaces its counts; the printer shows rows, errors,
the decoding tokens/s and ETA from the first batch on, as lines or a bar."""

from __future__ import annotations

import io

import pyarrow as pa
import pytest
import ray

from pipeline.progress import Progress, ProgressPrinter, table_counts
from tests.pipeline_fixtures import local_ray  # noqa: F401


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _read(printer: ProgressPrinter) -> Progress:
    return ray.get(printer.counter.read.remote())


def test_lines_count_each_batch_once_and_rates_start_at_the_first(local_ray):  # noqa: F811
    lines: list[str] = []
    with ProgressPrinter("job", 16, lines.append, interval=0.0) as printer:
        printer.counter.report.remote("block-a", (4, 1, 40, 30))
        printer.poll()
        assert lines[-1].startswith(
            "[progress] 4/16 rows (1 errors) | - tok/s decoding | mean NFE 10.0 | ETA - | elapsed "
        )
        printer.counter.report.remote("block-a", (8, 1, 100, 70))  # its second batch
        printer.counter.report.remote("block-b", (4, 0, 20, 10))
        progress = _read(printer)
        assert (progress.rows, progress.errors, progress.tokens, progress.nfe) == (12, 1, 120, 80)
        assert progress.tokens_per_second > 0 and progress.rows_per_second > 0
        printer.counter.report.remote("block-b", (4, 0, 20, 10))  # a retried block: no double
        printer.counter.report.remote("block-c", (4, 0, 24, 12))
    assert lines[-1].startswith("[progress] 16/16 rows (1 errors) | ")
    assert " tok/s decoding | mean NFE 6.1 | ETA 0s | elapsed " in lines[-1]
    assert f"{printer.decode_tokens_per_second:.1f} tok/s decoding" in lines[-1]
    assert [4, 40, 30] in [s[1:] for s in printer.samples]
    assert printer.samples[-1][1:] == [16, 144, 92]


def test_a_terminal_gets_a_bar(local_ray):  # noqa: F811
    terminal = Terminal()
    lines: list[str] = []
    with ProgressPrinter("job", 8, lines.append, interval=0.0, bar=terminal) as printer:
        printer.counter.report.remote("block-a", (8, 0, 64, 16))
    assert [line.split(" after ")[0] for line in lines] == ["[job] Ray ready"]
    shown = terminal.getvalue().split("\r")[-1]
    assert shown.startswith("[job] 100%|") and "8/8 rows" in shown
    assert shown.rstrip().endswith(", 0 errors | - tok/s decoding | mean NFE 2.0 | ETA 0s]")


def test_start_up_reads_as_phases_before_rows(local_ray):  # noqa: F811
    """Ray, then the replicas loading the model (each says when its engine is built; one
    restarted under the same actor id counts once), then the first batch, then rows."""
    lines: list[str] = []
    with ProgressPrinter("job", 16, lines.append, interval=0.0, replicas=2) as printer:
        assert lines[0].startswith("[job] Ray ready after ")
        assert lines[0].endswith(" s; loading the model on 2 replicas")
        printer.poll()
        assert lines[-1].startswith(
            "[progress] 0/16 rows | loading the model: 0/2 replicas ready | elapsed "
        )
        printer.counter.ready.remote("replica-a", 4.25)
        printer.poll()
        assert lines[-2] == "[job] model loaded on 1/2 replicas (4.2 s)"
        printer.counter.ready.remote("replica-a", 4.5)  # restarted: the same replica
        printer.counter.ready.remote("replica-b", 6.0)
        printer.poll()
        assert lines[-2] == "[job] model loaded on 2/2 replicas (6.0 s); generating 16 rows"
        assert lines[-1].startswith("[progress] 0/16 rows | first batch decoding | elapsed ")
        printer.counter.report.remote("block-a", (4, 0, 40, 30))
        printer.poll()
        assert lines[-1].startswith("[progress] 4/16 rows (0 errors) | - tok/s decoding | ")
    assert list(printer.phases) == ["ray", "replicas_ready", "first_rows"]
    assert printer.phases["ray"] <= printer.phases["replicas_ready"] <= printer.phases["first_rows"]


def test_counts_of_written_rows():
    table = pa.table(
        {
            "error": [None, "prompt is empty", None],
            "num_generated_tokens": [5, None, 7],
            "nfe": [3, None, 4],
        }
    )
    assert table_counts(table) == (3, 1, 12, 7)


def test_samples_are_thinned_not_truncated(monkeypatch):
    monkeypatch.setattr(ProgressPrinter, "MAX_SAMPLES", 8)
    printer = ProgressPrinter("job", 100, print, interval=10.0)
    for second in range(20):
        printer._sample([float(second), second, 0, 0])
    assert len(printer.samples) <= 8
    assert printer.samples[0][0] == 0.0 and printer.samples[-1][0] == 19.0


@pytest.mark.parametrize(("seconds", "shown"), [(9.4, "9s"), (65, "1m05s"), (3725, "1h02m")])
def test_durations(seconds, shown):
    from pipeline.progress import _duration

    assert _duration(seconds) == shown
