"""Recording a target's draft-free trajectories as a Ray job over a job's replicas.

The job file gives the target, the decoding and the input rows (and samples) to record; its
drafter is ignored (a recording is draft-free). Each replica records a block of requests at a
time and writes each engine batch of it as one shard file in the output folder (any pyarrow
file system), through a hidden temporary renamed when complete and named by a hash of its
request keys, so a block retried after a crash replaces its own shards. A shard holds its
requests' whole trajectories; the drafter commands read the folder as one recording
(`Trajectories.load`), in the same order however many replicas or shards made it. Submitting
again to the same folder records only the requests it does not hold yet.
"""

from __future__ import annotations

import hashlib
import io
import posixpath
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
from ray.data import DataContext

from pipeline.inputs import InputPlan
from pipeline.job import DrafterConfig, Job
from pipeline.output import PARTIAL_SUFFIX, OutputDir, row_keys, write_atomically
from pipeline.runner import ray_session, read_input
from pipeline.schema import ID, ROW_ERROR, SAMPLE_INDEX
from pipeline.stages import expand_samples, on_replicas, rows_per_block
from spot.noise import request_key

Echo = Callable[[str], None]
SHARD_PREFIX = "shard-"
SHARD_SUFFIX = ".pt"
ERRORS_SHOWN = 5


def shard_name(keys: list[int]) -> str:
    """A name fixed by the shard's request keys, so a retried block overwrites its own shard."""
    digest = hashlib.blake2b(digest_size=12)
    for key in sorted(keys):
        digest.update(key.to_bytes(8, "little"))
    return f"{SHARD_PREFIX}{digest.hexdigest()}{SHARD_SUFFIX}"


class RecordingFolder:
    """The shard files of one recording (a local folder or a URI)."""

    def __init__(self, path: str):
        location = OutputDir(path)
        self.filesystem, self.root, self.uri = location.filesystem, location.root, location.uri

    def _files(self) -> list[pafs.FileInfo]:
        if self.filesystem.get_file_info(self.root).type != pafs.FileType.Directory:
            return []
        return self.filesystem.get_file_info(pafs.FileSelector(self.root))

    def shards(self) -> list[str]:
        return sorted(
            i.path
            for i in self._files()
            if i.base_name.startswith(SHARD_PREFIX) and i.base_name.endswith(SHARD_SUFFIX)
        )

    def remove_partial_files(self) -> None:
        """Delete temporaries left by writes that were killed."""
        for info in self._files():
            if info.base_name.endswith(PARTIAL_SUFFIX):
                self.filesystem.delete_file(info.path)

    def recorded_keys(self) -> set[int]:
        """The request keys the shards already hold."""
        import torch

        keys: set[int] = set()
        for path in self.shards():
            with self.filesystem.open_input_file(path) as stream:
                body = torch.load(io.BytesIO(stream.read()), weights_only=True)
            keys.update(body["key"].unique().tolist())
        return keys

    def write(self, name: str, data: bytes) -> None:
        write_atomically(self.filesystem, posixpath.join(self.root, name), lambda f: f.write(data))


class RecordingActor:
    """One replica: the job's target (draft-free), recording a block of rows per call, a
    shard per engine batch. Returns one row per input row: its shard, or why it was not
    recorded."""

    def __init__(self, job: Job, out: str, hidden: bool):
        import torch

        from pipeline.engine import Engine

        torch.set_num_threads(max(1, round(job.resources.num_cpus)))
        self.job = job
        self.engine = Engine(job.model_copy(update={"drafter": DrafterConfig()}))
        self.folder = RecordingFolder(out)
        self.hidden = hidden

    def __call__(self, batch: pa.Table) -> pa.Table:
        import torch

        from spot.decode import Request
        from spot.drafters.recipes import record_trajectories

        errors: list[str | None] = []
        requests: list[Request] = []
        for row in batch.to_pylist():
            ids, error = self.engine.prompt_ids(row.get(ROW_ERROR), row)
            errors.append(error)
            if error is None:
                key = request_key(row[ID], row[SAMPLE_INDEX])
                requests.append(Request(torch.tensor(ids, dtype=torch.long), key))
        # a shard per engine batch: what one shard holds (and a replica keeps in memory
        # before writing it) stays small however large the blocks are
        size = self.job.resources.batch_size
        names: list[str] = []
        for start in range(0, len(requests), size):
            chunk = requests[start : start + size]
            traj = record_trajectories(
                self.engine.target, chunk, self.engine.config, size, self.hidden
            )
            traj.meta["model"] = self.job.model.path.text
            names += [shard_name([r.key for r in chunk])] * len(chunk)
            self.folder.write(names[-1], traj.to_bytes())
        recorded = iter(names)
        shards = [None if error else next(recorded) for error in errors]
        return pa.table(
            {
                ID: batch.column(ID),
                SAMPLE_INDEX: batch.column(SAMPLE_INDEX),
                "shard": pa.array(shards, pa.string()),
                "error": pa.array(errors, pa.string()),
            }
        )


@dataclass
class RecordingResult:
    """What one `record_job` run did."""

    requests: int  # (row, sample) pairs of the input
    already: int  # of them, recorded before this run
    recorded: int = 0  # recorded by this run
    shards: set[str] = field(default_factory=set)
    errors: list[str] = field(default_factory=list)  # `id: reason` of rows not recorded


def record_job(
    job: Job,
    plan: InputPlan,
    out: str,
    hidden: bool,
    *,
    ray_address: str | None = None,
    echo: Echo = print,
) -> RecordingResult:
    """Record every (row, sample) of the job's input (`plan`: `pipeline.inputs.plan_input`)
    not yet in `out`, as shards."""
    folder = RecordingFolder(out)
    folder.remove_partial_files()
    done = _done_rows(plan.keys, job.decoding.samples_per_prompt, folder.recorded_keys())
    total = plan.num_rows * job.decoding.samples_per_prompt
    result = RecordingResult(requests=total, already=len(done))
    pending = total - len(done)
    echo(
        f"[{job.name}] recording {plan.num_rows} input rows x {job.decoding.samples_per_prompt} "
        f"samples; {len(done)} already recorded, {pending} to record -> {folder.uri}"
    )
    if pending:
        with ray_session(job, ray_address):
            DataContext.get_current().print_on_execution_start = False
            actor = {"job": job, "out": out, "hidden": hidden}
            rows = expand_samples(
                read_input(plan), job, done=done, duplicate_ids=plan.duplicate_ids
            )
            rows = on_replicas(rows, job, RecordingActor, actor, rows_per_block(pending, job))
            for batch in rows.iter_batches(batch_format="pyarrow", batch_size=None):
                for row_id, sample, shard, error in zip(
                    *(batch.column(n).to_pylist() for n in (ID, SAMPLE_INDEX, "shard", "error"))
                ):
                    if error is None:
                        result.recorded += 1
                        result.shards.add(shard)
                    else:
                        result.errors.append(f"{row_id} (sample {sample}): {error}")
    echo(
        f"[{job.name}] recorded {result.recorded} requests in {len(result.shards)} shards, "
        f"{len(result.errors)} not recorded; {len(folder.shards())} shards in {folder.uri}"
    )
    for line in result.errors[:ERRORS_SHOWN]:
        echo(f"  not recorded: {line}")
    return result


def _done_rows(ids: pa.Array, samples: int, recorded: set[int]) -> pa.Array:
    """Row keys (`id<US>sample_index`, as the pipeline skips them) of the (row, sample) pairs
    whose request key is in `recorded`."""
    if not recorded:
        return pa.array([], pa.string())
    done = []
    for sample in range(samples):
        found = [request_key(i, sample) in recorded for i in ids.to_pylist()]
        keys = row_keys(ids, pa.array(np.full(len(ids), sample, dtype=np.int64)))
        done.append(keys.filter(pa.array(found)))
    return pa.concat_arrays(done)
