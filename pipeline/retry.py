"""A resubmit generates again the rows whose generation failed (`error_kind` "generation":
an exception inside the target or drafter, perhaps transient), unless told not to.

Before the run, each part holding such rows is rewritten without them under its own name
(the rest of its rows written to a hidden temporary, renamed over the part; a part left
empty is deleted), so their keys are pending again. data/ never holds two rows for one
(id, sample_index): a crash before a rename leaves that part as it was (its rows are
retried by the next resubmit), a crash after it leaves the rows pending. The part keeps its
name: no later part can take that name, since a part's name hashes all the keys it was
written with, and the kept ones are never written again. Rows whose input is at fault
("input", and errors without a kind, written before kinds were recorded) are kept: a retry
would fail the same way.
"""

from __future__ import annotations

from collections.abc import Iterator

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pipeline.output import OutputDir, write_atomically

ERROR_KIND = "error_kind"
GENERATION = "generation"


def _retried(kinds: pa.Array | pa.ChunkedArray) -> pa.Array:
    return pc.fill_null(pc.equal(kinds, GENERATION), False)


def parts_to_retry(output: OutputDir) -> Iterator[tuple[str, int]]:
    """(part, rows to retry in it) for each part holding rows whose generation failed,
    reading the `error_kind` column alone."""
    for path in output.part_files():
        count = sum(
            pc.sum(_retried(batch.column(ERROR_KIND))).as_py() or 0
            for batch in output.batches([ERROR_KIND], [path])
            if ERROR_KIND in batch.schema.names
        )
        if count:
            yield path, count


def remove_for_retry(output: OutputDir, paths: list[str]) -> int:
    """Rewrite each part of `paths` without its rows to retry (see the module docstring);
    returns the rows removed."""
    removed = 0
    for path in paths:
        with output.filesystem.open_input_file(path) as file:
            table = pq.read_table(file)  # the schema's metadata (the run that wrote it) stays
        kept = table.filter(pc.invert(_retried(table.column(ERROR_KIND))))
        if kept.num_rows == 0:
            output.filesystem.delete_file(path)
        else:
            write_atomically(output.filesystem, path, lambda f, t=kept: pq.write_table(t, f))
        removed += table.num_rows - kept.num_rows
    return removed
