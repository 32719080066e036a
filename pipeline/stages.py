"""The Ray Data stages around the model: expanding input rows into samples (skipping what is
already written), tokenizing them and detokenizing the completions on CPUs (as Ray Data LLM
runs its tokenize and detokenize stages), and writing part files. Importing this module
imports no torch, so the read and write workers start fast; the text stages load their
tokenizer in their own actors."""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import ray
from ray.data.block import BlockAccessor
from ray.data.datasource import Datasink
from ray.data.datasource.datasink import WriteResult

from pipeline.inputs import id_keys
from pipeline.job import Job
from pipeline.output import OutputDir, row_keys, write_part
from pipeline.schema import ID, ROW_ERROR, SAMPLE_INDEX


class AtomicParquetDatasink(Datasink[int]):
    """Each write task writes its blocks as one part file, atomically (see pipeline.output)."""

    def __init__(self, output: OutputDir):
        self.output = output
        self.rows_written = 0

    def write(self, blocks, ctx) -> int:
        return write_part(self.output, (BlockAccessor.for_block(b).to_arrow() for b in blocks))

    def on_write_complete(self, write_result: WriteResult[int]) -> None:
        self.rows_written = sum(write_result.write_returns)


def expand_rows(
    batch: pa.Table,
    *,
    renamed: dict[str, str],
    samples: int,
    shared: dict[str, Any],
) -> pa.Table:
    """Input rows -> one row per (row, sample), rows already written dropped; marks rows
    whose id is null or duplicated, or that could not be read, with their error before any
    model sees them."""
    done, duplicates = ray.get([shared["done"], shared["duplicates"]])
    batch = batch.rename_columns([renamed[n] for n in batch.column_names])
    keys = id_keys(batch.column(ID))
    position = pc.index_in(keys, value_set=duplicates.column("key"))
    counts = pc.take(duplicates.column("count"), position).to_pylist()
    nulls = pc.is_null(batch.column(ID)).to_pylist()
    errors = [
        "id is null"
        if is_null
        else f"duplicate id: appears {count} times in the input"
        if count is not None
        else None
        for is_null, count in zip(nulls, counts)
    ]
    if ROW_ERROR in batch.column_names:  # rows the JSON Lines reader could not read
        unread = batch.column(ROW_ERROR).to_pylist()
        errors = [reason or error for reason, error in zip(unread, errors)]
        batch = batch.drop_columns([ROW_ERROR])
    batch = batch.append_column(ROW_ERROR, pa.array(errors, pa.string()))
    rows = np.repeat(np.arange(batch.num_rows), samples)
    expanded = batch.take(rows).append_column(
        SAMPLE_INDEX, pa.array(np.tile(np.arange(samples, dtype=np.int64), batch.num_rows))
    )
    if len(done) == 0:
        return expanded
    written = pc.is_in(row_keys(expanded.column(ID), expanded.column(SAMPLE_INDEX)), value_set=done)
    return expanded.filter(pc.invert(written))


def first_key(batch: pa.Table) -> str:
    """The row key (`id<US>sample_index`) of the batch's first row: a name for the batch
    that a retry of it repeats ("" for no rows)."""
    keys = row_keys(batch.column(ID).slice(0, 1), batch.column(SAMPLE_INDEX).slice(0, 1))
    return keys[0].as_py() if len(keys) else ""


class TokenizeStage:
    """Before the model: each row's prompt ids through the chat template, or its error
    (`pipeline.engine.tokenize_rows`); the tokenizer is loaded once per actor."""

    def __init__(self, job: Job):
        from pipeline.engine import load_tokenizer

        self.job = job
        self.tokenizer = load_tokenizer(job)

    def __call__(self, batch: pa.Table) -> pa.Table:
        from pipeline.engine import tokenize_rows

        return tokenize_rows(self.tokenizer, self.job.input, batch)


class DetokenizeStage:
    """After the model: the completions' text, cut at the first stop string
    (`pipeline.engine.detokenize_rows`). The replicas report their rows' tokens before the
    cut to the progress counter; the tokens a cut removes are reported here (under the
    batch's own name), so the totals end as the rows are written."""

    def __init__(self, job: Job, progress: ray.actor.ActorHandle | None = None):
        from pipeline.engine import load_tokenizer

        self.job = job
        self.tokenizer = load_tokenizer(job)
        self.progress = progress  # a pipeline.progress.ProgressCounter

    def __call__(self, batch: pa.Table) -> pa.Table:
        from pipeline.engine import detokenize_rows

        out = detokenize_rows(self.tokenizer, self.job.decoding.stop, batch)
        if self.progress is not None and self.job.decoding.stop:
            cut = _total(batch, "num_generated_tokens") - _total(out, "num_generated_tokens")
            if cut:
                self.progress.report.remote(f"stop strings {first_key(batch)}", (0, 0, -cut, 0))
        return out


def _total(table: pa.Table, column: str) -> int:
    return pc.sum(table.column(column)).as_py() or 0
