"""Run a job on Ray Data: read_parquet -> expand samples, skip done rows -> tokenize (CPU) ->
repartition -> map_batches(GenerationActor) -> detokenize (CPU) -> atomic Parquet parts,
then summary.json.

Embedded local Ray by default (started and stopped here, files in a temporary folder under
/tmp); `ray_address` connects to an existing cluster instead (used inside a Ray Jobs
submission, see `submit_to_cluster`).
"""

from __future__ import annotations

import math
import os
import shlex
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TextIO

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import ray
from ray.data import ActorPoolStrategy, DataContext

from pipeline.fingerprint import claim_output
from pipeline.inputs import InputPlan, plan_input, read_jsonl_files
from pipeline.job import Job
from pipeline.output import OutputDir, row_keys
from pipeline.progress import ProgressPrinter, table_counts
from pipeline.ray_auth import private_token
from pipeline.stages import (
    AtomicParquetDatasink,
    DetokenizeStage,
    TokenizeStage,
    expand_rows,
    first_key,
)
from pipeline.summary import build_summary, output_totals
from spot.builtin import is_builtin

Echo = Callable[[str], None]

# Blocks are what replicas are handed and what part files hold: enough of them that every
# replica gets work and a crash loses little, few enough that part files stay large.
BLOCKS_PER_REPLICA = 4
MAX_BATCHES_PER_BLOCK = 32
# ...but no more blocks than this in one run: Ray Data keeps statistics of every block each
# operator outputs in the driver until the run ends (ray-project/ray#66016, ~40 KB per
# block through this pipeline), so a 50M-row job in 256-row blocks would hold ~8 GiB.
MAX_BLOCKS_PER_RUN = 10_000
# A replica decodes a block continuously, its batch refilled as requests finish, until the
# block's last batch drains: at least this many batches per block keep that tail short.
MIN_BATCHES_PER_BLOCK = 4
# CPUs a tokenize or detokenize actor reserves (up to one of each per replica). Their work
# is light; a fractional reservation beside the replicas could leave no node the whole CPU
# a read or write task needs, and the job would hang without an error.
TEXT_STAGE_CPUS = 0


class GenerationActor:
    """One replica: builds the engine once, then maps blocks of tokenized rows to output
    rows holding token ids (`Engine.generate_rows`). (torch is imported here, in the
    replica: the driver never loads it.)"""

    def __init__(self, job: Job, progress: ray.actor.ActorHandle | None = None):
        import torch

        from pipeline.engine import Engine

        torch.set_num_threads(max(1, round(job.resources.num_cpus)))
        self.engine = Engine(job)
        self.progress = progress  # a pipeline.progress.ProgressCounter
        self.block = ""
        self.counts = (0, 0, 0, 0)
        if progress is not None:
            self.engine.on_batch = self._batch_done

    def __call__(self, batch: pa.Table) -> pa.Table:
        self.block, self.counts = first_key(batch), (0, 0, 0, 0)
        out = self.engine.generate_rows(batch)
        if self.progress is not None:  # the block's rows as written replace its batches'
            self.progress.report.remote(self.block, table_counts(out))
        return out

    def _batch_done(self, *counts: int) -> None:
        self.counts = tuple(a + b for a, b in zip(self.counts, counts))
        self.progress.report.remote(self.block, self.counts)


def count_pending(plan: InputPlan, samples: int, done: pa.Array, slice_rows: int = 1 << 18) -> int:
    """(row, sample) pairs of the input not yet in the output. The input's keys are matched
    a slice at a time (at most 8 slices per sample): the hash sets are built over a slice,
    not over every key written, so the driver holds little beside the keys themselves."""
    if len(done) == 0:
        return plan.num_rows * samples
    step = max(slice_rows, math.ceil(plan.num_rows / 8))
    written = 0
    for sample in range(samples):
        for start in range(0, plan.num_rows, step):
            ids = plan.keys.slice(start, step)
            keys = row_keys(ids, pa.array(np.full(len(ids), sample, dtype=np.int64)))
            found = done.filter(pc.is_in(done, value_set=keys))  # written keys of this slice
            written += pc.sum(pc.is_in(keys, value_set=found).cast(pa.int64())).as_py()
    return plan.num_rows * samples - written


def rows_per_block(pending_rows: int, job: Job) -> int:
    """Rows per block (and per replica call): BLOCKS_PER_REPLICA blocks per replica, but
    no fewer than MIN_BATCHES_PER_BLOCK batches unless that is more than a replica's share,
    nor more than MAX_BATCHES_PER_BLOCK batches unless the run would then exceed
    MAX_BLOCKS_PER_RUN blocks."""
    batch, replicas = job.resources.batch_size, job.resources.replicas
    wanted = math.ceil(pending_rows / (replicas * BLOCKS_PER_REPLICA))
    least = max(batch, min(batch * MIN_BATCHES_PER_BLOCK, math.ceil(pending_rows / replicas)))
    block = min(max(wanted, least), batch * MAX_BATCHES_PER_BLOCK)
    return max(block, math.ceil(pending_rows / MAX_BLOCKS_PER_RUN))


@contextmanager
def ray_session(job: Job, address: str | None) -> Iterator[None]:
    """Connect to `address`, reuse a running local Ray, or start an embedded one sized so
    the read and write tasks always find a free CPU beside the replicas, private to this run
    (token authentication with a token made for it, see pipeline.ray_auth)."""
    if ray.is_initialized():
        yield
        return
    if address is not None:
        ray.init(address=address)
        try:
            yield
        finally:
            ray.shutdown()
        return
    # Ray starts its workers at niceness 15, so its daemons stay responsive; here the
    # replicas are the job, and at 15 they yield the CPU to every other process on the
    # machine, the driver included.
    os.environ.setdefault("RAY_worker_niceness", "0")
    temp_dir = tempfile.mkdtemp(prefix="spot-ray-")
    replica_cpus = math.ceil(job.resources.replicas * job.resources.num_cpus)
    with private_token():
        ray.init(
            num_cpus=max(4, replica_cpus + 2),
            _temp_dir=temp_dir,
            include_dashboard=False,
            configure_logging=False,
        )
        try:
            yield
        finally:
            ray.shutdown()
            shutil.rmtree(temp_dir, ignore_errors=True)


def run_job(
    job: Job,
    *,
    actor_class: type = GenerationActor,
    ray_address: str | None = None,
    echo: Echo = print,
    progress_interval: float = 10.0,
    progress_bar: TextIO | None = None,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Generate every (id, sample) not yet in job.output.path; returns the new summary.
    An output holding rows of another fingerprint is refused (pipeline.fingerprint) unless
    `overwrite` empties it first. Progress: a bar drawn on `progress_bar` (a terminal) when
    given, else lines through `echo`."""
    output = claim_output(job, overwrite)
    plan = plan_input(job.input)
    output.remove_partial_files()
    written_before = output.part_files()
    done = output.done_keys(written_before)
    pending = count_pending(plan, job.decoding.samples_per_prompt, done)
    echo(
        f"[{job.name}] {plan.num_rows} input rows x {job.decoding.samples_per_prompt} samples; "
        f"{len(done)} already written, {pending} to generate -> {output.uri}"
    )
    started = datetime.now(UTC).isoformat(timespec="seconds")
    start = time.perf_counter()
    progress = ProgressPrinter(job.name, pending, echo, progress_interval, progress_bar)
    failure = None
    try:
        if pending:
            with ray_session(job, ray_address), progress:
                _execute(job, plan, output, done, pending, actor_class, progress.counter)
    except BaseException as error:
        failure = f"{type(error).__name__}: {error}".splitlines()[0][:500]
        raise
    finally:
        wall = time.perf_counter() - start
        new_parts = set(output.part_files()) - set(written_before)
        counted, written = output_totals(output, new_parts)
        previous = output.read_summary() or {}
        this_run = _run_record(job, written, started, wall, progress.samples, failure)
        summary = build_summary(job, counted, [*previous.get("runs", []), this_run])
        output.write_summary(summary)
    totals = summary["totals"]
    echo(
        f"[{job.name}] done: {totals['rows']} rows ({totals['errors']} errors), "
        f"{totals['generated_tokens']} tokens, mean NFE {totals.get('nfe_mean', 0.0):.1f}, "
        f"{this_run['generated_tokens'] / max(wall, 1e-9):.1f} tok/s this run, {wall:.1f}s"
    )
    return summary


def _execute(
    job: Job,
    plan: InputPlan,
    output: OutputDir,
    done: pa.Array,
    pending: int,
    actor_class: type,
    counter: ray.actor.ActorHandle,
) -> None:
    """The Ray Data pipeline, streaming from the input to part files; the replicas report
    to `counter` (pipeline.progress), so Ray Data's own progress output is turned off."""
    DataContext.get_current().enable_progress_bars = False
    actor_kwargs = {"job": job, "progress": counter}
    dataset = replica_rows(job, plan, done, pending, actor_class, actor_kwargs, tokenize=True)
    dataset = dataset.map_batches(
        DetokenizeStage,
        batch_format="pyarrow",
        batch_size=None,  # a replica's output block at a time
        fn_constructor_kwargs={"job": job, "progress": counter},
        **_text_stage(job),
    )
    dataset.write_datasink(AtomicParquetDatasink(output))


def _text_stage(job: Job) -> dict[str, Any]:
    """Resources of a tokenize or detokenize stage: a pool of CPU actors reserving
    TEXT_STAGE_CPUS each, one to as many as there are replicas."""
    pool = ActorPoolStrategy(min_size=1, max_size=job.resources.replicas)
    return {"compute": pool, "num_cpus": TEXT_STAGE_CPUS}


def replica_rows(
    job: Job,
    plan: InputPlan,
    done: pa.Array,
    pending: int,
    actor_class: type,
    actor_kwargs: dict[str, Any],
    *,
    tokenize: bool = False,
) -> ray.data.Dataset:
    """The job's (row, sample) pairs not in `done` (read, expanded, cut into blocks sized for
    its replicas), mapped a block per call by `resources.replicas` actors of
    `actor_class(**actor_kwargs)`: what generation writes as parts, recording as shards.
    `tokenize`: a CPU stage first gives each row its prompt ids (`TokenizeStage`), so the
    actors receive token ids."""
    context = DataContext.get_current()
    context.print_on_execution_start = False
    if plan.limited is not None:
        dataset = ray.data.from_arrow(plan.limited)
    elif plan.reader is not None:  # JSON Lines, read line by line (pipeline.inputs)
        dataset = ray.data.from_items([{"path": f} for f in plan.files]).map_batches(
            read_jsonl_files,
            batch_size=1,
            batch_format="pyarrow",
            fn_kwargs={"reader": plan.reader, "filesystem": plan.filesystem},
        )
    else:
        dataset = ray.data.read_parquet(plan.files, filesystem=plan.filesystem)
    shared = {"done": ray.put(done), "duplicates": ray.put(plan.duplicate_ids)}
    dataset = dataset.map_batches(
        expand_rows,
        batch_format="pyarrow",
        fn_kwargs={
            "renamed": plan.renamed,
            "samples": job.decoding.samples_per_prompt,
            "shared": shared,
        },
    )
    block = rows_per_block(pending, job)
    if tokenize:
        dataset = dataset.map_batches(
            TokenizeStage,
            batch_format="pyarrow",
            batch_size=block,
            fn_constructor_kwargs={"job": job},
            **_text_stage(job),
        )
    dataset = dataset.repartition(target_num_rows_per_block=block)
    dataset = dataset.map_batches(
        actor_class,
        batch_format="pyarrow",
        batch_size=block,  # a block per call: the engine batches its rows itself
        compute=ActorPoolStrategy(size=job.resources.replicas),
        fn_constructor_kwargs=actor_kwargs,
        num_cpus=job.resources.num_cpus,
        num_gpus=job.resources.num_gpus,
    )  # Ray Data's defaults restart a replica that dies and retry its batch elsewhere
    return dataset


def _run_record(
    job: Job,
    written: dict[str, Any],
    started: str,
    wall: float,
    samples: list[list[float]],
    failure: str | None,
) -> dict[str, Any]:
    """This run's share of the output: the totals of the parts it wrote (a part holds only
    rows that were not written before, so new parts are exactly the new rows)."""
    rows, tokens = written["rows"], written["generated_tokens"]
    return {
        "status": "failed" if failure else "succeeded",
        "error": failure,
        "started_at": started,
        "wall_seconds": wall,
        "replicas": job.resources.replicas,
        "rows_written": rows,
        "generated_tokens": tokens,
        "tokens_per_second": tokens / wall if wall > 0 else None,
        "progress": samples,
    }


def submit_to_cluster(
    job: Job, address: str, echo: Echo = print, command: Sequence[str] = ("submit",)
) -> None:
    """Submit the job through the Ray Jobs API and follow its logs until it ends; in the
    cluster, `spot-pipeline <command> job.yaml --in-cluster` runs it."""
    import asyncio

    from ray.job_submission import JobStatus, JobSubmissionClient

    client = JobSubmissionClient(address)
    packages = [
        str(Path(__file__).resolve().parent),
        str(Path(__file__).resolve().parents[1] / "spot"),
    ]
    entrypoint = [command[0], "job.yaml", *command[1:], "--in-cluster"]
    with tempfile.TemporaryDirectory(prefix="spot-job-") as working_dir:
        Path(working_dir, "job.yaml").write_text(_portable(job).to_yaml())
        job_id = client.submit_job(
            entrypoint=shlex.join(["python", "-m", "pipeline.cli", *entrypoint]),
            runtime_env={"working_dir": working_dir, "py_modules": packages},
        )
    echo(f"[{job.name}] submitted as Ray job {job_id} to {address}")

    async def follow() -> None:
        async for lines in client.tail_job_logs(job_id):
            echo(lines.rstrip("\n"))

    asyncio.run(follow())
    status = client.get_job_status(job_id)
    if status != JobStatus.SUCCEEDED:
        raise RuntimeError(
            f"Ray job {job_id} ended {status}: what it wrote is kept; submit again to finish"
        )


def _portable(job: Job) -> Job:
    """The job with local paths made absolute, so the cluster reads the same files."""

    def absolute(path: str | None) -> str | None:
        if path is None or is_builtin(path) or "://" in path:
            return path
        return os.path.abspath(os.path.expanduser(path))

    return job.model_copy(
        update={
            "input": job.input.model_copy(update={"path": absolute(job.input.path)}),
            "model": job.model.model_copy(update={"path": absolute(job.model.path)}),
            "drafter": job.drafter.model_copy(update={"path": absolute(job.drafter.path)}),
            "output": job.output.model_copy(update={"path": absolute(job.output.path)}),
        }
    )
