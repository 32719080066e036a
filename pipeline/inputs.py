"""The input side: which files a job reads (Parquet, or JSON Lines such as the bundled
prompt sets), and what must hold of them before Ray starts: id and prompt columns present,
input columns that share a name with an output column renamed, duplicate ids found."""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as pds
import pyarrow.fs as pafs

from pipeline.job import InputConfig, JobError, resolve_path
from pipeline.schema import GENERATED_FIELDS, ID, PROMPT, SAMPLE_INDEX


@dataclass(frozen=True)
class InputPlan:
    """What the job will read, found by one pass over the id column."""

    filesystem: pafs.FileSystem
    files: list[str]
    format: str  # "parquet" | "json"
    schema: pa.Schema  # the input's own columns
    renamed: dict[str, str]  # input column -> output column (id, prompt, input_<clash>)
    num_rows: int
    keys: pa.Array  # every row's id as a string key (see id_keys), in input order
    duplicate_ids: pa.Table  # columns key (string), count (int64): ids seen more than once
    limited: pa.Table | None  # the first `input.limit` rows, when a limit is set


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
    path = resolve_path(config.path)
    if "://" not in path and any(ch in path for ch in "*?["):
        matches = sorted(p for p in glob.glob(path, recursive=True) if os.path.isfile(p))
        return pafs.LocalFileSystem(), matches
    filesystem, root = pafs.FileSystem.from_uri(path if "://" in path else os.path.abspath(path))
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
    return pc.fill_null(keys, "\x00null")


def plan_input(config: InputConfig) -> InputPlan:
    """Check the input and find duplicate ids; raises JobError naming input.* keys."""
    filesystem, files = input_files(config)
    if not files:
        raise JobError([f"input.path: no .parquet or .jsonl files at {config.path!r}"])
    file_format = input_format(files)
    try:
        dataset = pds.dataset(files, filesystem=filesystem, format=file_format)
        schema = dataset.schema
    except (pa.ArrowInvalid, OSError) as error:
        raise JobError([f"input.path: cannot read {file_format}: {error}"]) from error
    problems = []
    for key, column in (
        ("input.id_column", config.id_column),
        ("input.prompt_column", config.prompt_column),
    ):
        if column not in schema.names:
            problems.append(f"{key}: no column {column!r} in the input (columns: {schema.names})")
    if problems:
        raise JobError(problems)
    renamed = output_names(schema.names, config.id_column, config.prompt_column)
    limited = None
    if config.limit is not None:
        limited = dataset.head(config.limit)
        ids = limited.column(config.id_column)
    else:
        ids = dataset.to_table(columns=[config.id_column]).column(config.id_column)
    keys = id_keys(ids)
    keys = keys.combine_chunks() if isinstance(keys, pa.ChunkedArray) else keys
    counts = pc.value_counts(keys)
    repeated = pc.greater(counts.field("counts"), 1)
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
        renamed=renamed,
        num_rows=len(ids),
        keys=keys,
        duplicate_ids=duplicates,
        limited=limited,
    )


def output_names(columns: list[str], id_column: str, prompt_column: str) -> dict[str, str]:
    """Each input column's name in the output: id and prompt columns become `id` and
    `prompt`; a column whose name an output column takes is kept as `input_<name>`."""
    taken = {f.name for f in GENERATED_FIELDS} | {ID, PROMPT, SAMPLE_INDEX} | set(columns)
    names = {}
    for column in columns:
        if column == id_column:
            names[column] = ID
        elif column == prompt_column:
            names[column] = PROMPT
        elif column in {f.name for f in GENERATED_FIELDS} | {ID, PROMPT, SAMPLE_INDEX}:
            name = f"input_{column}"
            while name in taken:
                name = f"input_{name}"
            taken.add(name)
            names[column] = name
        else:
            names[column] = column
    return names
