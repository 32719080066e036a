"""What `spot-pipeline submit` does to its output before a run, in this order, so that
nothing is written before the lease is held:

1. take the output's lease (`pipeline.lease`): a second submit is refused, naming the
   holder; the lease of a submit that is gone is taken over;
2. claim the output (`fingerprint.claim_output`): `--overwrite` empties it; rows of
   another fingerprint or another input are refused (`pipeline.identity`);
3. record the runs that ended without their record as `lost` (`summary.record_lost_runs`);
4. mark this run (`runs/<run id>.json`) and remove the rows whose generation failed, so
   that the run generates them again (`pipeline.retry`; not with `--no-retry-failed`).

`hold_output` does all four and yields the `Run`; leaving it releases the lease.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from pipeline.fingerprint import claim_output
from pipeline.inputs import InputPlan
from pipeline.job import Job, JobError
from pipeline.lease import Lease
from pipeline.output import OutputDir
from pipeline.retry import parts_to_retry, remove_for_retry
from pipeline.runner import Run
from pipeline.summary import record_lost_runs

Echo = Callable[[str], None]
T = TypeVar("T")


@contextmanager
def hold_output(
    job: Job,
    plan: InputPlan,
    *,
    overwrite: bool = False,
    extend: bool = False,
    retry_failed: bool = True,
    echo: Echo = print,
    on_lost: Callable[[str], None] | None = None,
) -> Iterator[Run]:
    """The job's run, its output held and prepared (see the module docstring); raises
    JobError before anything is written when the output is held, or cannot be resumed."""
    output = _io(OutputDir, job.output.path)
    lease = Lease(output, "submit", on_lost=on_lost)
    taken = lease.acquire()
    try:
        if taken:
            echo(f"[{job.name}] {taken}")
        claim_output(job, plan, overwrite, extend, echo)
        _io(record_lost_runs, output, job, lease.run_id, echo)
        parts = _io(lambda: list(parts_to_retry(output))) if retry_failed else []
        retrying = sum(count for _, count in parts)
        _io(lease.mark_run, job.resources.replicas, retrying)
        removed = _io(remove_for_retry, output, [path for path, _ in parts])
        if removed:
            echo(
                f"[{job.name}] {removed} row(s) whose generation failed are generated again "
                "(--no-retry-failed keeps them)"
            )
        yield Run(job, plan, output, run_id=lease.run_id, rows_retried=removed)
    finally:
        lease.release(recorded=_recorded(output, lease.run_id))


def _recorded(output: OutputDir, run_id: str) -> bool:
    """summary.json holds the record of run `run_id`."""
    try:
        summary = output.read_summary() or {}
    except (OSError, ValueError):
        return False
    return any(run.get("run_id") == run_id for run in summary.get("runs", []))


def _io(call: Callable[..., T], *args: Any) -> T:
    """`call(*args)` on the output; an OSError (a full disk, a folder without permission)
    becomes a JobError naming output.path."""
    try:
        return call(*args)
    except OSError as error:
        raise JobError([f"output.path: {error}"]) from error
