"""The Ray Data stages of generation: expanding input rows into samples (marking rows that
cannot be generated, skipping what is already written), tokenizing them and detokenizing the
completions on CPU actors (as Ray Data LLM runs its tokenize and detokenize stages), the
model replicas between them, and writing part files; and how rows are cut into the blocks a
replica takes per call. `pipeline.processor` chains them. Importing this module imports no
torch, so the read and write workers start fast; the text stages load their tokenizer, and
the replicas their model, in their own actors."""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import ray
from ray.data import ActorPoolStrategy
from ray.data.block import BlockAccessor
from ray.data.datasource import Datasink

from pipeline.identity import row_digests
from pipeline.inputs import id_keys, output_names
from pipeline.job import InputConfig, Job
from pipeline.output import OutputDir, row_keys, write_part
from pipeline.progress import table_counts
from pipeline.schema import ID, INPUT_DIGEST, MESSAGES, PROMPT, ROW_ERROR, SAMPLE_INDEX
from pipeline.text import detokenize_rows, load_tokenizer, tokenize_rows

# Blocks are what replicas are handed and what part files hold: enough of them that every
# replica gets work and a crash loses little, few enough that part files stay large.
BLOCKS_PER_REPLICA = 4
# Blocks a replica holds at once (calls in flight): their rows feed its one decode loop, so
# while one call's last rows decode, the next call's rows fill the batch.
CALLS_PER_REPLICA = 3
MAX_BATCHES_PER_BLOCK = 32
# ...but no more blocks than this in one run: Ray Data keeps statistics of every block each
# operator outputs in the driver until the run ends (ray-project/ray#66016, ~40 KB per
# block through this pipeline), so a 50M-row job in 256-row blocks would hold ~8 GiB.
MAX_BLOCKS_PER_RUN = 10_000
# At least this many batches per block (unless that is more than a replica's share): part
# files of a few rows would be many and small.
MIN_BATCHES_PER_BLOCK = 4
# CPUs a tokenize or detokenize actor reserves (up to one of each per replica). Their work
# is light; a fractional reservation beside the replicas could leave no node the whole CPU
# a read or write task needs, and the job would hang without an error.
TEXT_STAGE_CPUS = 0


def rows_per_block(pending_rows: int | None, job: Job) -> int:
    """Rows per block (and per replica call): BLOCKS_PER_REPLICA blocks per replica, but
    no fewer than MIN_BATCHES_PER_BLOCK batches unless that is more than a replica's share,
    nor more than MAX_BATCHES_PER_BLOCK batches unless the run would then exceed
    MAX_BLOCKS_PER_RUN blocks. Rows of an unknown number: MAX_BATCHES_PER_BLOCK batches."""
    batch, replicas = job.resources.batch_size, job.resources.replicas
    if pending_rows is None:
        return batch * MAX_BATCHES_PER_BLOCK
    wanted = math.ceil(pending_rows / (replicas * BLOCKS_PER_REPLICA))
    least = max(batch, min(batch * MIN_BATCHES_PER_BLOCK, math.ceil(pending_rows / replicas)))
    block = min(max(wanted, least), batch * MAX_BATCHES_PER_BLOCK)
    return max(block, math.ceil(pending_rows / MAX_BLOCKS_PER_RUN))


class AtomicParquetDatasink(Datasink[int]):
    """Each write task writes its blocks as one part file, atomically, its metadata naming
    the run (see pipeline.output), and counts its rows to the run's
    `pipeline.control.RunControl` when given one."""

    def __init__(
        self,
        output: OutputDir,
        run: str | None = None,
        control: ray.actor.ActorHandle | None = None,
    ):
        self.output = output
        self.run = run
        self.control = control

    def write(self, blocks, ctx) -> int:
        tables = (BlockAccessor.for_block(b).to_arrow() for b in blocks)
        rows = write_part(self.output, tables, self.run)
        if self.control is not None:
            ray.get(self.control.written_rows.remote(rows))
        return rows


def expand_rows(
    batch: pa.Table,
    *,
    config: InputConfig,
    samples: int,
    done: pa.Array | None = None,
    duplicate_ids: pa.Table | None = None,
) -> pa.Table:
    """Input rows -> one row per (row, sample), their columns named as the output names
    them (`pipeline.inputs.output_names`) with the row's INPUT_DIGEST
    (`pipeline.identity.row_digests`), rows whose key is in `done` dropped; marks rows
    whose id is null or in `duplicate_ids` (columns key, count: `InputPlan.duplicate_ids`),
    or that could not be read, with their error before any model sees them."""
    batch = batch.rename_columns(list(output_names(batch.column_names, config).values()))
    text = MESSAGES if config.messages_column is not None else PROMPT
    batch = batch.append_column(INPUT_DIGEST, row_digests(batch.column(ID), batch.column(text)))
    nulls = pc.is_null(batch.column(ID)).to_pylist()
    counts = [None] * batch.num_rows
    if duplicate_ids is not None:
        position = pc.index_in(id_keys(batch.column(ID)), value_set=duplicate_ids.column("key"))
        counts = pc.take(duplicate_ids.column("count"), position).to_pylist()
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
    if done is None or len(done) == 0:
        return expanded
    written = pc.is_in(row_keys(expanded.column(ID), expanded.column(SAMPLE_INDEX)), value_set=done)
    return expanded.filter(pc.invert(written))


def _expand_shared(batch: pa.Table, *, shared: dict[str, Any], **options: Any) -> pa.Table:
    """`expand_rows` with `done` and `duplicate_ids` from the object store (refs, or None),
    put there once for every task."""
    refs = {name: ref for name, ref in shared.items() if ref is not None}
    values = dict(zip(refs, ray.get(list(refs.values())))) if refs else {}
    return expand_rows(batch, **options, **values)


def expand_samples(
    dataset: ray.data.Dataset,
    job: Job,
    *,
    done: pa.Array | None = None,
    duplicate_ids: pa.Table | None = None,
) -> ray.data.Dataset:
    """`dataset`'s rows expanded into the job's samples (`expand_rows`)."""
    shared = {
        "done": None if done is None else ray.put(done),
        "duplicate_ids": None if duplicate_ids is None else ray.put(duplicate_ids),
    }
    return dataset.map_batches(
        _expand_shared,
        batch_format="pyarrow",
        fn_kwargs={
            "config": job.input,
            "samples": job.decoding.samples_per_prompt,
            "shared": shared,
        },
    )


def text_stage(job: Job) -> dict[str, Any]:
    """Resources of a tokenize or detokenize stage: a pool of CPU actors reserving
    TEXT_STAGE_CPUS each, one to as many as there are replicas."""
    pool = ActorPoolStrategy(min_size=1, max_size=job.resources.replicas)
    return {"compute": pool, "num_cpus": TEXT_STAGE_CPUS}


def on_replicas(
    dataset: ray.data.Dataset,
    job: Job,
    actor_class: type,
    actor_kwargs: dict[str, Any],
    block: int,
) -> ray.data.Dataset:
    """`dataset` cut into blocks of `block` rows, mapped a block per call by
    `resources.replicas` actors of `actor_class(**actor_kwargs)`, each with the replica's
    CPUs and GPUs and CALLS_PER_REPLICA calls in flight (an async `__call__`, as Ray Data
    LLM's engine stages run theirs)."""
    dataset = dataset.repartition(target_num_rows_per_block=block)
    pool = ActorPoolStrategy(
        size=job.resources.replicas,
        max_tasks_in_flight_per_actor=CALLS_PER_REPLICA,
        max_concurrent_calls_per_actor=CALLS_PER_REPLICA,
    )
    return dataset.map_batches(
        actor_class,
        batch_format="pyarrow",
        batch_size=block,  # a block per call: the engine batches its rows itself
        compute=pool,
        fn_constructor_kwargs=actor_kwargs,
        num_cpus=job.resources.num_cpus,
        num_gpus=job.resources.num_gpus,
    )  # Ray Data's defaults restart a replica that dies and retry its calls elsewhere


def first_key(batch: pa.Table) -> str:
    """The row key (`id<US>sample_index`) of the batch's first row: a name for the batch
    that a retry of it repeats ("" for no rows)."""
    keys = row_keys(batch.column(ID).slice(0, 1), batch.column(SAMPLE_INDEX).slice(0, 1))
    return keys[0].as_py() if len(keys) else ""


class TokenizeStage:
    """Before the model: each row's prompt ids through the chat template, or its error
    (`pipeline.text.tokenize_rows`); the tokenizer is loaded once per actor."""

    def __init__(self, job: Job):
        self.job = job
        self.tokenizer = load_tokenizer(job)

    def __call__(self, batch: pa.Table) -> pa.Table:
        return tokenize_rows(self.tokenizer, self.job.input, batch)


class DetokenizeStage:
    """After the model: the completions' text, cut at the first stop string
    (`pipeline.text.detokenize_rows`). The replicas report their rows' tokens before the
    cut to the progress counter; the tokens a cut removes are reported here (under the
    batch's own name), so the totals end as the rows are written."""

    def __init__(self, job: Job, progress: ray.actor.ActorHandle | None = None):
        self.job = job
        self.tokenizer = load_tokenizer(job)
        self.progress = progress  # a pipeline.progress.ProgressCounter

    def __call__(self, batch: pa.Table) -> pa.Table:
        out = detokenize_rows(self.tokenizer, self.job.decoding.stop, batch)
        if self.progress is not None and self.job.decoding.stop:
            cut = _total(batch, "num_generated_tokens") - _total(out, "num_generated_tokens")
            if cut:
                self.progress.report.remote(f"stop strings {first_key(batch)}", (0, 0, -cut, 0))
        return out


class GenerationActor:
    """One replica: builds the engine once, then maps blocks of tokenized rows to output
    rows holding token ids. The blocks it holds at once (CALLS_PER_REPLICA calls) all feed
    the engine's one decode loop (`pipeline.decoder`), so its batch stays full across
    calls; each call returns its own rows when they are done. Progress goes to a
    `pipeline.progress.ProgressCounter`, drains and failures through a
    `pipeline.control.RunControl`. (torch is imported here, in the replica: the driver never
    loads it.)"""

    def __init__(
        self,
        job: Job,
        progress: ray.actor.ActorHandle | None = None,
        control: ray.actor.ActorHandle | None = None,
        learner: ray.actor.ActorHandle | None = None,
    ):
        """learner: the job's `pipeline.learning.Learner`, when it learns its drafter: the
        replica records its rows for it and takes each drafter it hands out."""
        started = time.perf_counter()
        import torch

        from pipeline.control import ReplicaControl
        from pipeline.engine import Engine

        torch.set_num_threads(max(1, round(job.resources.num_cpus)))
        self.engine = Engine(job)
        self.recording = None
        if learner is not None:
            from pipeline.learning import DrafterWatch, RowRecording

            self.recording = self.engine.recording = RowRecording(learner, self.engine)
            self.watch = DrafterWatch(learner, self.recording, self._use)
        self.progress = progress
        if progress is not None:
            self.engine.on_progress = lambda call, counts: progress.report.remote(call, counts)
            replica = ray.get_runtime_context().get_actor_id() or ""
            progress.ready.remote(replica, time.perf_counter() - started)
        self.control = None if control is None else ReplicaControl(control, self.engine)

    async def __call__(self, batch: pa.Table) -> pa.Table:
        name = first_key(batch)
        rows = self.engine.submit_rows(batch, name)
        await asyncio.wrap_future(rows.call.done)
        if self.recording is not None:
            self.recording.send()
        out = rows.table()
        if self.progress is not None:  # the block's rows as written replace its counts
            self.progress.report.remote(name, table_counts(out))
        if self.control is not None:
            await self.control.returned(out.num_rows)
        return out

    def _use(self, handout: Any) -> None:
        """A drafter the learner handed out (`pipeline.learning.Handout`), to the engine."""
        self.engine.use_drafter(handout.kind, handout.load, handout.label)


def _total(table: pa.Table, column: str) -> int:
    return pc.sum(table.column(column)).as_py() or 0
