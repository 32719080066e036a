"""Which input an output was made from, so that a resubmit completes the same job only
(docs/design.md §4, Resume).

Every output row keeps `input_digest`: 8 bytes of BLAKE2b over its id and its prompt (or
its conversation), the only input values that decide its tokens besides the job's settings
(fingerprint.json). `OUT/input.json` records the input as the output last saw it: its
location, its files (name, size, modification time) and how many rows were read.

A resubmit whose input files are the recorded ones reads nothing more. When they differ
(another input.path, a file rewritten, added or removed), the driver reads the input's id
and prompt columns once, a batch at a time, and checks every row written against it: an id
whose prompt changed, or one the input no longer holds, refuses the resubmit (naming the
first ids), and so does an input that grew, unless `submit --extend` asks for its new rows.
An input whose written rows all match is the same job wherever it now lives: it resumes.
`input.limit` may change freely: more or fewer rows of the same files is a deliberate edit.
"""

from __future__ import annotations

import hashlib
import json
import math
import posixpath
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from pipeline.inputs import NULL_KEY, InputPlan, id_keys
from pipeline.job import InputConfig, JobError
from pipeline.output import OutputDir, write_atomically
from pipeline.schema import ID, INPUT_DIGEST

INPUT_FILE = "input.json"
NULL_TEXT = "\x00null"  # a missing prompt: no real prompt equals it
SHOWN_IDS = 3  # ids named in a refusal
SLICE_ROWS = 1 << 18  # least input keys per slice when matching (see runner.count_pending)


class InputChanged(JobError):
    """The output holds rows made from another input, or the input grew (see the module)."""


def row_digests(ids: pa.Array | pa.ChunkedArray, texts: pa.Array | pa.ChunkedArray) -> pa.Array:
    """int64 digests of (id, prompt or conversation) rows: BLAKE2b-64 of the id's key
    (`inputs.id_keys`), a unit separator and the text (a conversation as the JSON of its
    [role, content] pairs)."""
    joined = pc.binary_join_element_wise(id_keys(ids), _as_text(texts), "\x1f")
    if isinstance(joined, pa.ChunkedArray):
        joined = joined.combine_chunks()
    if len(joined) == 0:
        return pa.array([], pa.int64())
    offset_type = np.int64 if pa.types.is_large_string(joined.type) else np.int32
    offsets = np.frombuffer(joined.buffers()[1], offset_type)
    offsets = offsets[joined.offset : joined.offset + len(joined) + 1].tolist()
    data = memoryview(joined.buffers()[2] or b"")
    blake2b = hashlib.blake2b
    digests = b"".join(
        [blake2b(data[a:b], digest_size=8).digest() for a, b in zip(offsets, offsets[1:])]
    )
    return pa.array(np.frombuffer(digests, np.int64))


def _as_text(texts: pa.Array | pa.ChunkedArray) -> pa.Array:
    """Prompts as strings; conversations as the JSON of their [role, content] pairs."""
    if pa.types.is_list(texts.type) or pa.types.is_large_list(texts.type):
        values = [
            None if turns is None else json.dumps([[t["role"], t["content"]] for t in turns])
            for turns in texts.to_pylist()
        ]
        texts = pa.array(values, pa.string())
    elif texts.type != pa.string():
        texts = pc.cast(texts, pa.string())
    return pc.fill_null(texts, NULL_TEXT)


def text_column(config: InputConfig) -> str:
    """The input column whose value (with the id) decides a row's prompt."""
    return config.messages_column or config.prompt_column


@dataclass(frozen=True)
class InputRecord:
    """The input as an output saw it (`OUT/input.json`)."""

    path: str  # input.path, portable
    files: list[list[Any]]  # [path, size, mtime_ns] per file, in reading order
    rows: int  # rows read (after input.limit)
    limit: int | None

    @classmethod
    def of(cls, plan: InputPlan, config: InputConfig) -> InputRecord:
        infos = plan.filesystem.get_file_info(plan.files)
        files = [[i.path, i.size, i.mtime_ns] for i in infos]
        return cls(config.path.portable, files, plan.num_rows, config.limit)

    def same_files(self, other: InputRecord) -> bool:
        """The same files, unchanged (a file system that gives no modification time
        cannot say so)."""
        known = all(f[2] is not None for f in self.files)
        return known and (self.path, self.files) == (other.path, other.files)


def read_record(output: OutputDir) -> InputRecord | None:
    path = _path(output)
    if output.filesystem.get_file_info(path).type != pafs.FileType.File:
        return None
    with output.filesystem.open_input_stream(path) as stream:
        return InputRecord(**json.loads(stream.read().decode()))


def write_record(output: OutputDir, record: InputRecord) -> None:
    text = json.dumps(record.__dict__, indent=2).encode()
    write_atomically(output.filesystem, _path(output), lambda f: f.write(text))


def _path(output: OutputDir) -> str:
    return posixpath.join(output.root, INPUT_FILE)


def input_batches(plan: InputPlan, config: InputConfig) -> Iterator[pa.Table | pa.RecordBatch]:
    """The id and prompt (or messages) columns of every row the plan reads, in the order
    of `plan.keys`, a batch at a time."""
    columns = [config.id_column, text_column(config)]
    if plan.limited is not None:
        yield plan.limited.select(columns)
    elif plan.reader is not None:
        for table in plan.reader.tables(plan.filesystem, plan.files):
            yield table.select(columns)
    else:
        for path in plan.files:
            with plan.filesystem.open_input_file(path) as file:
                yield from pq.ParquetFile(file).iter_batches(65_536, columns=columns)


def input_digests(plan: InputPlan, config: InputConfig) -> pa.Array:
    """`row_digests` of every row the plan reads, aligned with `plan.keys`."""
    digests = [
        row_digests(batch.column(config.id_column), batch.column(text_column(config)))
        for batch in input_batches(plan, config)
    ]
    digests = pa.concat_arrays(digests) if digests else pa.array([], pa.int64())
    if len(digests) != plan.num_rows:
        raise JobError(
            [f"input.path: changed while it was read ({plan.num_rows} rows, then {len(digests)})"]
        )
    return digests


@dataclass
class Comparison:
    """The rows written, matched by id against the input's rows."""

    rows: int = 0  # rows written
    unchecked: int = 0  # rows written before digests were kept: not compared
    changed: int = 0  # ids written whose prompt in the input is another
    absent: int = 0  # ids written that the input does not hold
    first_changed: list[tuple[int, str]] = field(default_factory=list)  # (input row, id)
    first_absent: list[str] = field(default_factory=list)
    first_unwritten: list[str] = field(default_factory=list)  # input ids not written


def compare_written(output: OutputDir, plan: InputPlan, digests: pa.Array) -> Comparison:
    """Match every row written (its id and digest: two small columns) against the input's
    rows (`plan.keys`, `digests`). The input is matched in at most 8 slices, so the hash
    sets are built over a slice, never over every key written (as `runner.count_pending`
    does). Rows of ids the input repeats, or of rows without an id, are error rows whose id
    names no one row: they are not compared."""
    keys, written = [], []
    for batch in output.batches([ID, INPUT_DIGEST]):
        keys.append(id_keys(batch.column(ID)))
        if INPUT_DIGEST in batch.schema.names:
            written.append(batch.column(INPUT_DIGEST))
        else:
            written.append(pa.nulls(batch.num_rows, pa.int64()))
    result = Comparison()
    if not keys:
        return result
    keys, written = pa.concat_arrays(keys), pa.concat_arrays(written)
    result.rows, result.unchecked = len(keys), written.null_count
    shared = pa.concat_arrays(
        [plan.duplicate_ids.column("key").combine_chunks(), pa.array([NULL_KEY])]
    )
    compared = pc.invert(pc.is_in(keys, value_set=shared))
    found = np.zeros(len(keys), dtype=bool)
    changed: list[tuple[int, str]] = []
    step = max(SLICE_ROWS, math.ceil(plan.num_rows / 8))
    for start in range(0, plan.num_rows, step):
        slice_keys = plan.keys.slice(start, step)
        position = pc.index_in(keys, value_set=slice_keys)  # null: not in this slice
        here = pc.is_valid(position)
        found |= here.to_numpy(zero_copy_only=False)
        at = position.filter(here)
        expected = digests.slice(start, step).take(at)
        differs = pc.and_(pc.not_equal(written.filter(here), expected), compared.filter(here))
        differs = pc.fill_null(differs, False)
        ids = keys.filter(here).filter(differs)
        result.changed += pc.count_distinct(ids).as_py()
        rows = pc.add(at.filter(differs), start).to_pylist()
        changed = sorted({*changed, *zip(rows, ids.to_pylist())})[:SHOWN_IDS]
        if len(result.first_unwritten) < SHOWN_IDS:
            unwritten = ~pc.is_in(slice_keys, value_set=shared).to_numpy(zero_copy_only=False)
            unwritten[at.to_numpy()] = False
            wanted = SHOWN_IDS - len(result.first_unwritten)
            result.first_unwritten += slice_keys.filter(pa.array(unwritten))[:wanted].to_pylist()
    result.first_changed = changed
    missing = pc.unique(keys.filter(pa.array(~found)))
    result.absent = len(missing)
    result.first_absent = missing.take(pc.sort_indices(missing))[:SHOWN_IDS].to_pylist()
    return result


def check_input(
    output: OutputDir, plan: InputPlan, config: InputConfig, extend: bool = False
) -> list[str]:
    """Raise InputChanged when the output's rows were made from another input, or when the
    input grew since the output's last submit and `extend` is not set (see the module
    docstring); else the lines worth telling the user (none when nothing changed). Reads
    only; `claim_output` records the input afterwards."""
    if not output.part_files():
        return []
    current, recorded = InputRecord.of(plan, config), read_record(output)
    if recorded is not None and recorded.same_files(current):
        return []
    comparison = compare_written(output, plan, input_digests(plan, config))
    before = (
        f" (the rows were made from {recorded.path})"
        if recorded and recorded.path != current.path
        else ""
    )
    problems = []
    if comparison.changed:
        shown = ", ".join(repr(key) for _, key in comparison.first_changed)
        problems.append(
            f"input: {comparison.changed} id(s) written have another prompt in the input now "
            f"(first: {shown}); resuming would keep the old prompts' completions"
        )
    if comparison.absent:
        shown = ", ".join(repr(key) for key in comparison.first_absent)
        problems.append(
            f"input: {comparison.absent} id(s) written are not in the input (first: {shown}): "
            f"input.path {config.path.text!r} is another input{before}"
        )
    if problems:
        raise InputChanged(
            [
                *problems,
                "submit with --overwrite to delete those rows and start again, or set "
                "another output.path",
            ]
        )
    grew = recorded is not None and recorded.limit == current.limit and current.rows > recorded.rows
    matched = f"the {comparison.rows} row(s) written all match it"
    if grew and not extend:
        shown = ", ".join(repr(key) for key in comparison.first_unwritten)
        raise InputChanged(
            [
                f"input: holds {current.rows} rows, {recorded.rows} when this output was last "
                f"submitted; {matched}; ids not generated yet: {shown}, ...",
                "submit with --extend to generate the new rows too, or --overwrite to start again",
            ]
        )
    notes = [f"input changed since this output's last submit{before}; {matched}"]
    if comparison.unchecked:
        notes.append(
            f"{comparison.unchecked} row(s) written before input digests were kept: not checked"
        )
    return notes
