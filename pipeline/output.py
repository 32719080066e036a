"""The output folder: Parquet parts under data/, written atomically, and what they already hold.

Layout of `output.path`:
  data/part-<hash>.parquet   the corpus (read it with pandas/pyarrow/datasets on data/)
  summary.json               the job, versions, totals (beside data/, so readers of data/
                             see Parquet only)
  report/                    plots and an HTML page (`spot-pipeline report`)
  fingerprint.json, input.json  what decided the rows (pipeline.fingerprint, .identity)
  lease.json, runs/          the submit writing now, and runs not yet recorded (pipeline.lease;
                             .lease.lock, in local folders, serializes taking the lease)

A part file is written under a hidden temporary name in data/ and renamed when complete, so
a reader never sees half a file. Its name is a hash of the (id, sample_index) keys it holds:
a write retried after a crash replaces its own file instead of adding a duplicate. Its
Parquet metadata names the run that wrote it (RUN_KEY), so a run that ended without its
record is still counted. A write that fails raises OutputWriteError: the path and the cause
in one line.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import posixpath
import re
from collections.abc import Iterable, Iterator
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from pipeline.inputs import id_keys
from pipeline.locations import Location
from pipeline.schema import ID, SAMPLE_INDEX

DATA_DIR = "data"
SUMMARY_FILE = "summary.json"
REPORT_DIR = "report"
RUNS_DIR = "runs"
DRAFTER_DIR = "drafter"  # a job that learns its drafter writes it here (pipeline.learning)
PARTIAL_SUFFIX = ".partial"
RUN_KEY = b"spot_pipeline.run"  # a part's Parquet metadata: the id of the run that wrote it
KEYS = [ID, SAMPLE_INDEX]
READ_BATCH_ROWS = 65_536


class OutputDir:
    """Paths inside one job's output folder (a location, or a path to parse as one), on any
    pyarrow file system."""

    def __init__(self, where: Location | str):
        where = where if isinstance(where, Location) else Location.parse(where)
        self.filesystem, self.root = where.filesystem()
        self.uri = where.resolved

    @property
    def data(self) -> str:
        return posixpath.join(self.root, DATA_DIR)

    @property
    def summary(self) -> str:
        return posixpath.join(self.root, SUMMARY_FILE)

    def part_files(self) -> list[str]:
        """Complete part files (temporary files are hidden and skipped)."""
        if self.filesystem.get_file_info(self.data).type != pafs.FileType.Directory:
            return []
        infos = self.filesystem.get_file_info(pafs.FileSelector(self.data))
        return sorted(
            i.path
            for i in infos
            if i.type == pafs.FileType.File
            and i.base_name.endswith(".parquet")
            and not i.base_name.startswith((".", "_"))
        )

    def remove_partial_files(self) -> int:
        """Delete temporaries left by writes that were killed; call before writing again."""
        if self.filesystem.get_file_info(self.data).type != pafs.FileType.Directory:
            return 0
        infos = self.filesystem.get_file_info(pafs.FileSelector(self.data))
        stale = [i.path for i in infos if i.base_name.endswith(PARTIAL_SUFFIX)]
        for path in stale:
            self.filesystem.delete_file(path)
        return len(stale)

    def read(self, columns: list[str]) -> pa.Table | None:
        """`columns` of every row (None before the first part); name the few you need."""
        batches = list(self.batches(columns))
        return pa.Table.from_batches(batches) if batches else None

    def batches(
        self, columns: list[str], files: list[str] | None = None
    ) -> Iterator[pa.RecordBatch]:
        """`columns` of the rows of `files` (default: every part), a batch at a time: what the
        driver counts streams through it, and the prompts, completions and token ids of a
        large output are never read at all. One file at a time: a dataset over every part
        would keep each part's footer in memory, more than the columns themselves."""
        for path in self.part_files() if files is None else files:
            with self.filesystem.open_input_file(path) as file:
                yield from pq.ParquetFile(file).iter_batches(READ_BATCH_ROWS, columns=columns)

    def done_keys(self, files: list[str] | None = None) -> pa.Array:
        """`id<US>sample_index` of every row already written in `files` (default: every
        part): the resume set, read from the two key columns alone."""
        keys = [row_keys(b.column(ID), b.column(SAMPLE_INDEX)) for b in self.batches(KEYS, files)]
        return pa.concat_arrays(keys) if keys else pa.array([], pa.string())

    def read_summary(self) -> dict[str, Any] | None:
        if self.filesystem.get_file_info(self.summary).type != pafs.FileType.File:
            return None
        with self.filesystem.open_input_stream(self.summary) as stream:
            return json.loads(stream.read().decode())

    def write_summary(self, summary: dict[str, Any]) -> None:
        write_atomically(
            self.filesystem,
            self.summary,
            lambda f: f.write(json.dumps(summary, indent=2).encode()),
        )


def row_keys(ids: pa.Array | pa.ChunkedArray, samples: pa.Array | pa.ChunkedArray) -> pa.Array:
    """One string key per output row: id and sample index joined by the unit separator."""
    keys = pc.binary_join_element_wise(id_keys(ids), pc.cast(samples, pa.string()), "\x1f")
    return keys.combine_chunks() if isinstance(keys, pa.ChunkedArray) else keys


class OutputWriteError(OSError):
    """A write into the output that failed: the path and the cause, in one line
    (`write_error`)."""


def write_error(path: str, cause: BaseException) -> OutputWriteError:
    return OutputWriteError(f"cannot write {path}: {_cause(cause)}")


def _cause(error: BaseException) -> str:
    """An OSError's cause in words ("No space left on device"), without Arrow's detail."""
    code = getattr(error, "errno", None)
    if code is None:  # Arrow: "... Detail: [errno 28] No space left on device"
        found = [int(c) for c in _ERRNO.findall(str(error))]
        code = found[-1] if found else None
    if code in errno.errorcode:
        return os.strerror(code)
    return str(error).splitlines()[0] if str(error) else type(error).__name__


_ERRNO = re.compile(r"\[errno (\d+)\]", re.IGNORECASE)


def write_atomically(filesystem: pafs.FileSystem, path: str, write) -> None:
    """Write through a hidden temporary beside `path`, then rename it into place (replacing
    what `path` held); raises OutputWriteError, leaving `path` as it was."""
    directory, name = posixpath.split(path)
    temporary = posixpath.join(directory, f".{name}{PARTIAL_SUFFIX}")
    try:
        filesystem.create_dir(directory, recursive=True)
        with filesystem.open_output_stream(temporary) as stream:
            write(stream)
        filesystem.move(temporary, path)
    except OSError as error:
        with contextlib.suppress(OSError):
            filesystem.delete_file(temporary)
        raise write_error(path, error) from error


def part_name(table: pa.Table) -> str:
    """A name fixed by the rows' keys, so a retried write overwrites its own part."""
    keys = row_keys(table.column(ID), table.column(SAMPLE_INDEX))
    ordered = keys.take(pc.sort_indices(keys))
    digest = hashlib.blake2b(digest_size=12)
    for key in ordered.to_pylist():
        digest.update(key.encode())
        digest.update(b"\x1e")
    return f"part-{digest.hexdigest()}.parquet"


def write_part(output: OutputDir, tables: Iterable[pa.Table], run: str | None = None) -> int:
    """Write the rows of `tables` as one part file, atomically, its metadata naming `run`;
    returns the rows written."""
    tables = [t for t in tables if t.num_rows]
    if not tables:
        return 0
    table = pa.concat_tables(tables, promote_options="default")
    if run is not None:
        table = table.replace_schema_metadata({**(table.schema.metadata or {}), RUN_KEY: run})
    path = posixpath.join(output.data, part_name(table))
    write_atomically(output.filesystem, path, lambda f: pq.write_table(table, f))
    return table.num_rows


def part_run(output: OutputDir, path: str) -> str | None:
    """The id of the run that wrote the part at `path` (None: a part from before runs had
    ids), from its footer alone."""
    with output.filesystem.open_input_file(path) as file:
        metadata = pq.ParquetFile(file).schema_arrow.metadata or {}
    run = metadata.get(RUN_KEY)
    return None if run is None else run.decode()
