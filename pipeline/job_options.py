"""What the commands that take a JOB_FILE share: the `--set` option, and the job loaded (or
its input planned) or else its problems printed, one per line, with exit status 2."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

import click

T = TypeVar("T")  # what a checked call returns

set_option = click.option(
    "--set",
    "overrides",
    multiple=True,
    metavar="KEY.PATH=VALUE",
    help="Override a job key, its value written as in YAML: --set decoding.temperature=0.7, "
    "--set input.limit=null, --set 'decoding.stop=[\"####\"]' (repeatable).",
)


def or_exit(header: str, check: Callable[[], T]) -> T:
    """What `check` returns; when it raises JobError, `header` and its problems, one per
    line, and exit status 2."""
    with exits_on_job_error(header):
        return check()


@contextmanager
def exits_on_job_error(header: str) -> Iterator[None]:
    """A JobError raised inside: `header` and its problems, one per line, and exit status
    2."""
    from pipeline.job import JobError

    try:
        yield
    except JobError as error:
        click.echo(header, err=True)
        for problem in error.problems:
            click.echo(f"  {problem}", err=True)
        sys.exit(2)


def load_or_exit(job_file: str, overrides: tuple[str, ...]):
    """The job of `job_file` with `overrides`, validated and checked (`pipeline.job`)."""
    from pipeline.job import load_job

    return or_exit(f"invalid job {job_file}:", lambda: load_job(job_file, overrides))


def plan_or_exit(job, job_file: str):
    """The job's input plan (`pipeline.inputs.plan_input`)."""
    from pipeline.inputs import plan_input

    return or_exit(f"invalid job {job_file}:", lambda: plan_input(job.input))
