"""The input side: which files a job reads (Parquet, or JSON Lines such as the bundled
prompt sets), and what must hold of them before Ray starts: id and prompt (or messages)
columns present, input columns that share a name with an output column renamed, duplicate
ids found.

JSON Lines are read line by line (`JsonlReader`), not by Arrow's JSON reader, which fails a
whole file on one bad line: a line that is not a JSON object, or a value that does not fit
its column, becomes a row whose `_row_error` says why, and every other row is read. A line
that is not a JSON object gets `FILE:LINE` as its id (`location`) and the error names file
and line. Ids of JSON Lines are text, whatever their JSON type, so the output's id type does
not depend on which lines could be read (the noise key of an id is its text: completions do
not change). Another column's type is the one its values share (integers and floats widen
to floats); a column whose values have different JSON types is carried as text (JSON text
for the values that are not strings). The prompt column is text (any other value is the
row's error), the messages column a list of role/content turns.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as pds
import pyarrow.fs as pafs

from pipeline.job import InputConfig, JobError
from pipeline.prompts import messages_problem
from pipeline.schema import (
    GENERATED_FIELDS,
    ID,
    INPUT_DIGEST,
    MESSAGES,
    PROMPT,
    ROW_ERROR,
    SAMPLE_INDEX,
)

NULL_KEY = "\x00null"  # the key of a row without an id: no real id equals it
JSONL_BATCH_ROWS = 1024  # rows per table the JSON Lines reader yields
MESSAGES_TYPE = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))


@dataclass(frozen=True)
class InputPlan:
    """What the job will read, found by one pass over the id column."""

    filesystem: pafs.FileSystem
    files: list[str]
    format: str  # "parquet" | "json"
    schema: pa.Schema  # the input's own columns
    num_rows: int
    keys: pa.Array  # every row's id as a string key (see id_keys), in input order
    duplicate_ids: pa.Table  # columns key (string), count (int64): ids seen more than once
    limited: pa.Table | None  # the first `input.limit` rows, when a limit is set
    reader: JsonlReader | None = None  # JSON Lines: how rows are read (schema found here)
    unreadable: int = 0  # JSON Lines rows that cannot be read: they become error rows

    def rows(self) -> pa.Table | pds.Dataset:
        """Every row the job reads (the limited rows, the Parquet files, or the JSON Lines
        read whole), for taking samples; a job streams them instead."""
        if self.limited is not None:
            return self.limited
        if self.reader is not None:
            tables = [t for f in self.files for t in self.reader.tables(self.filesystem, f)]
            return pa.concat_tables(tables) if tables else self.reader.schema.empty_table()
        return pds.dataset(self.files, filesystem=self.filesystem, format=self.format)


INPUT_FORMATS = {".parquet": "parquet", ".jsonl": "json"}


def input_format(files: list[str]) -> str:
    """parquet or json, from the files' extensions; raises JobError when they disagree."""
    formats = {INPUT_FORMATS.get(os.path.splitext(f)[1].lower()) for f in files}
    if len(formats) != 1 or None in formats:
        raise JobError(["input.path: expected .parquet files or .jsonl files, not a mixture"])
    return formats.pop()


def input_files(config: InputConfig) -> tuple[pafs.FileSystem, list[str]]:
    """The input files named by input.path (a file, a folder, a glob or a URI), sorted; a
    folder contributes its .parquet files, or its .jsonl files when it has no Parquet."""
    where = config.path
    if where.is_glob:
        matches = sorted(p for p in glob.glob(where.resolved, recursive=True) if os.path.isfile(p))
        return pafs.LocalFileSystem(), matches
    filesystem, root = where.filesystem()
    info = filesystem.get_file_info(root)
    if info.type == pafs.FileType.File:
        return filesystem, [root]
    if info.type != pafs.FileType.Directory:
        return filesystem, []
    selector = pafs.FileSelector(root, recursive=True)
    visible = [
        f.path
        for f in filesystem.get_file_info(selector)
        if f.type == pafs.FileType.File and not f.base_name.startswith((".", "_"))
    ]
    for extension in (".parquet", ".jsonl"):
        files = sorted(p for p in visible if p.endswith(extension))
        if files:
            return filesystem, files
    return filesystem, []


def id_keys(ids: pa.Array | pa.ChunkedArray) -> pa.Array:
    """Ids as strings, the form they take in resume and duplicate checks (null -> a sentinel
    no real id can equal, so rows without an id are tracked too)."""
    keys = pc.cast(ids, pa.string()) if ids.type != pa.string() else ids
    return pc.fill_null(keys, NULL_KEY)


def repeated_keys(keys: pa.Array) -> pa.StructArray:
    """The keys seen more than once and how often (`values`, `counts`, as pc.value_counts
    gives them), found by sorting: a hash table of every id costs the driver several times
    the ids themselves."""
    ordered = keys.take(pc.sort_indices(keys))
    same = pc.equal(ordered[1:], ordered[:-1])  # each key against the one before it
    repeated = pc.unique(ordered[1:].filter(same))
    return pc.value_counts(ordered.filter(pc.is_in(ordered, value_set=repeated)))


def plan_input(config: InputConfig) -> InputPlan:
    """Check the input and find duplicate ids; raises JobError naming input.* keys."""
    filesystem, files = input_files(config)
    if not files:
        raise JobError([f"input.path: no .parquet or .jsonl files at {config.path.text!r}"])
    file_format = input_format(files)
    reader = None
    unreadable = 0
    try:
        if file_format == "json":
            reader, ids, unreadable = scan_jsonl(filesystem, files, config)
            schema = reader.schema
        else:
            dataset = pds.dataset(files, filesystem=filesystem, format=file_format)
            schema = dataset.schema
    except (pa.ArrowInvalid, OSError) as error:
        raise JobError([f"input.path: cannot read {file_format}: {error}"]) from error
    text_column = (
        ("input.messages_column", config.messages_column)
        if config.messages_column is not None
        else ("input.prompt_column", config.prompt_column)
    )
    problems = []
    for key, column in (("input.id_column", config.id_column), text_column):
        if column not in schema.names:
            columns = [n for n in schema.names if n != ROW_ERROR]
            problems.append(f"{key}: no column {column!r} in the input (columns: {columns})")
    if problems:
        raise JobError(problems)
    wrong_type = text_column_problem(config, schema, reader, filesystem, files)
    if wrong_type:
        raise JobError([wrong_type])
    limited = None
    if reader is not None:
        if config.limit is not None:
            limited = pa.concat_tables(reader.tables(filesystem, files, config.limit))
    elif config.limit is not None:
        limited = dataset.head(config.limit)
        ids = limited.column(config.id_column)
    else:
        ids = dataset.to_table(columns=[config.id_column]).column(config.id_column)
    keys = id_keys(ids)
    keys = keys.combine_chunks() if isinstance(keys, pa.ChunkedArray) else keys
    counts = repeated_keys(keys)
    # rows without an id (or that cannot be read) are errors of their own, not duplicates
    repeated = pc.and_(
        pc.greater(counts.field("counts"), 1), pc.not_equal(counts.field("values"), NULL_KEY)
    )
    duplicates = pa.table(
        {
            "key": pc.filter(counts.field("values"), repeated),
            "count": pc.filter(counts.field("counts"), repeated),
        }
    )
    return InputPlan(
        filesystem=filesystem,
        files=files,
        format=file_format,
        schema=schema,
        num_rows=len(ids),
        keys=keys,
        duplicate_ids=duplicates,
        limited=limited,
        reader=reader,
        unreadable=unreadable,
    )


FIRST_ROWS = 100  # JSON Lines rows read to tell a prompt column from a column of another kind


def text_column_problem(
    config: InputConfig,
    schema: pa.Schema,
    reader: JsonlReader | None,
    filesystem: pafs.FileSystem,
    files: list[str],
) -> str | None:
    """Why the prompt (or messages) column holds no prompts, None when it may: its Parquet
    type, or in JSON Lines its values in the first FIRST_ROWS rows, none of them a prompt
    (text) or a conversation (a list of role/content turns). A row whose value is wrong is
    an error row; a column where none is right is the wrong column."""
    messages = config.messages_column is not None
    key, column = (
        ("input.messages_column", config.messages_column)
        if messages
        else ("input.prompt_column", config.prompt_column)
    )
    wanted = "list of {role, content} turns" if messages else "text"
    if reader is None:
        kind = schema.field(column).type
        if _holds_turns(kind) if messages else _is_text(kind):
            return None
        return f"{key}: column {column!r} is {kind}, not {'a ' if messages else ''}{wanted}"
    rows = [row for _, _, row, _ in _records(filesystem, files, FIRST_ROWS) if row is not None]
    values = [row[column] for row in rows if row.get(column) is not None]
    if messages:
        usable = any(messages_problem(value) is None for value in values)
    else:
        usable = any(isinstance(value, str) for value in values)
    if usable or not values:
        return None
    example = json.dumps(values[0])
    example = example if len(example) <= 60 else example[:57] + "..."
    return (
        f"{key}: column {column!r} holds no {wanted} in the first {len(rows)} rows (e.g. {example})"
    )


def _is_text(kind: pa.DataType) -> bool:
    if pa.types.is_dictionary(kind):
        kind = kind.value_type
    return pa.types.is_string(kind) or pa.types.is_large_string(kind)


def _holds_turns(kind: pa.DataType) -> bool:
    """A list of structs with text fields role and content (others may come along)."""
    if not (pa.types.is_list(kind) or pa.types.is_large_list(kind)):
        return False
    turn = kind.value_type
    if not pa.types.is_struct(turn):
        return False
    names = {turn.field(i).name: turn.field(i).type for i in range(turn.num_fields)}
    return all(name in names and _is_text(names[name]) for name in ("role", "content"))


def output_names(columns: list[str], config: InputConfig) -> dict[str, str]:
    """Each input column's name in the output: the id, prompt and messages columns become
    `id`, `prompt` and `messages` (the prompt column is an ordinary column in a messages
    job); a column whose name an output column takes is kept as `input_<name>`. The reader's
    `_row_error` keeps its name."""
    reserved = {f.name for f in GENERATED_FIELDS} | {ID, PROMPT, SAMPLE_INDEX, INPUT_DIGEST}
    special = {config.id_column: ID}
    if config.messages_column is not None:
        reserved.add(MESSAGES)
        special[config.messages_column] = MESSAGES
    else:
        special[config.prompt_column] = PROMPT
    taken = reserved | set(columns)
    names = {}
    for column in columns:
        if column in special:
            names[column] = special[column]
        elif column == ROW_ERROR:
            names[column] = ROW_ERROR
        elif column in reserved:
            name = f"input_{column}"
            while name in taken:
                name = f"input_{name}"
            taken.add(name)
            names[column] = name
        else:
            names[column] = column
    return names


def scan_jsonl(
    filesystem: pafs.FileSystem, files: list[str], config: InputConfig
) -> tuple[JsonlReader, pa.Array, int]:
    """One pass over JSON Lines files (up to input.limit rows): the reader with the column
    types the values share, every row's id, and how many rows cannot be read."""
    types: dict[str, pa.DataType | None] = {}  # None: values of different JSON types
    ids: list[Any] = []
    unreadable = 0
    for path, line, row, _ in _records(filesystem, files, config.limit):
        if row is None:
            unreadable += 1
            ids.append(location(path, line))
            continue
        ids.append(row.get(config.id_column))
        for name, value in row.items():
            if value is None:
                types.setdefault(name, pa.null())
            elif name not in types:
                types[name] = _json_type(value)
            elif types[name] is not None:
                types[name] = _widen(types[name], _json_type(value))
    fields, as_text = [], set()
    for name, kind in types.items():
        if name == config.messages_column:
            kind = MESSAGES_TYPE
        elif name == config.prompt_column and config.messages_column is None:
            kind = pa.string()
        elif kind is None or name == config.id_column:
            kind = pa.string()
            as_text.add(name)
        fields.append(pa.field(name, kind))
    fields.append(pa.field(ROW_ERROR, pa.string()))
    reader = JsonlReader(pa.schema(fields), config, frozenset(as_text))
    id_type = reader.schema.field(config.id_column).type if config.id_column in types else None
    id_values = [reader.convert(config.id_column, value)[0] for value in ids]
    return reader, pa.array(id_values, id_type), unreadable


@dataclass(frozen=True)
class JsonlReader:
    """Reads JSON Lines files into tables of one schema (found by `scan_jsonl`); a row that
    cannot be read keeps its place with `_row_error` set and null values."""

    schema: pa.Schema  # the input's columns and _row_error
    config: InputConfig
    as_text: frozenset[str] = field(default_factory=frozenset)  # columns of mixed JSON types

    def tables(
        self, filesystem: pafs.FileSystem, files: str | list[str], limit: int | None = None
    ) -> Iterator[pa.Table]:
        """The rows of `files` (the first `limit`), JSONL_BATCH_ROWS at a time."""
        records = []
        for record in _records(filesystem, [files] if isinstance(files, str) else files, limit):
            records.append(record)
            if len(records) == JSONL_BATCH_ROWS:
                yield self.table(records)
                records = []
        if records:
            yield self.table(records)

    def table(self, records: list[tuple[str, int, dict | None, str | None]]) -> pa.Table:
        names = [n for n in self.schema.names if n != ROW_ERROR]
        values: dict[str, list] = {name: [] for name in names}
        errors: list[list[str]] = []
        for path, line, row, error in records:
            problems = []
            if row is None:
                problems.append(f"{path} line {line}: {error}")
                row = {self.config.id_column: location(path, line)}
            for name in names:
                value, problem = self.convert(name, row.get(name))
                values[name].append(value)
                if problem:
                    problems.append(problem)
            errors.append(problems)
        arrays = [self._array(name, values[name], errors) for name in names]
        arrays.append(pa.array(["; ".join(p) or None for p in errors], pa.string()))
        return pa.Table.from_arrays(arrays, schema=self.schema)

    def convert(self, name: str, value: Any) -> tuple[Any, str | None]:
        """A JSON value as its column holds it, or None and why it cannot be."""
        if value is None:
            return None, None
        config = self.config
        if name == config.messages_column:
            problem = messages_problem(value)
            if problem:
                return None, problem
            return [{"role": t["role"], "content": t["content"]} for t in value], None
        if name == config.prompt_column and config.messages_column is None:
            if not isinstance(value, str):
                return None, f"prompt is not a string ({type(value).__name__})"
            return value, None
        if name in self.as_text:
            return value if isinstance(value, str) else json.dumps(value), None
        return value, None

    def _array(self, name: str, values: list, errors: list[list[str]]) -> pa.Array:
        """The column's array; a value that does not fit (an integer too large, a list of
        mixed items) is null and its row's error names the column."""
        kind = self.schema.field(name).type
        try:
            return pa.array(values, kind)
        except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError):
            pass
        fitted = []
        for i, value in enumerate(values):
            try:
                pa.array([value], kind)
                fitted.append(value)
            except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError):
                fitted.append(None)
                errors[i].append(f"column {name!r}: {json.dumps(value)[:80]} is not {kind}")
        return pa.array(fitted, kind)


def location(path: str, line: int) -> str:
    """The id of a JSON Lines row that cannot be read: unique, so the row is written,
    resumed and reported as a row of its own."""
    return f"{path}:{line}"


def read_jsonl_files(batch: pa.Table, *, reader: JsonlReader, filesystem: pafs.FileSystem):
    """A Ray Data stage over a table of file paths (column `path`): their rows."""
    for path in batch.column("path").to_pylist():
        yield from reader.tables(filesystem, path)


def _records(
    filesystem: pafs.FileSystem, files: list[str], limit: int | None = None
) -> Iterator[tuple[str, int, dict | None, str | None]]:
    """(file, line number, object or None, why not) for every non-blank line of `files`."""
    count = 0
    for path in files:
        with filesystem.open_input_stream(path) as stream:
            for number, line in enumerate(_lines(stream), 1):
                if limit is not None and count >= limit:
                    return
                if not line.strip():
                    continue
                count += 1
                try:
                    row = json.loads(line)
                except UnicodeDecodeError as error:
                    yield path, number, None, f"not UTF-8 text ({error.reason})"
                    continue
                except json.JSONDecodeError as error:
                    yield path, number, None, f"not valid JSON ({error.msg}, column {error.colno})"
                    continue
                if not isinstance(row, dict):
                    kind = type(row).__name__
                    yield path, number, None, f"not a JSON object of columns ({kind})"
                    continue
                yield path, number, row, None


def _lines(stream: pa.NativeFile, chunk: int = 1 << 20) -> Iterator[bytes]:
    pending = b""
    while data := stream.read(chunk):
        *lines, pending = (pending + data).split(b"\n")
        yield from lines
    if pending:
        yield pending


def _json_type(value: Any) -> pa.DataType | None:
    """The Arrow type of one JSON value (None: a list whose items have no common type)."""
    if isinstance(value, bool):
        return pa.bool_()
    if isinstance(value, int):
        return pa.int64()
    if isinstance(value, float):
        return pa.float64()
    if isinstance(value, str):
        return pa.string()
    try:
        return pa.infer_type([value])
    except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError):
        return None


def _widen(a: pa.DataType, b: pa.DataType | None) -> pa.DataType | None:
    """The type two columns' values share (ints and floats: floats; objects: the union of
    their fields), None when they have none."""
    if b is None or a == b or b == pa.null():
        return a if b is not None else None
    try:
        schemas = [pa.schema([("v", a)]), pa.schema([("v", b)])]
        return pa.unify_schemas(schemas, promote_options="permissive").field("v").type
    except (pa.ArrowInvalid, pa.ArrowTypeError, NotImplementedError):
        return None
