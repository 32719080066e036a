"""`spot-pipeline estimate`: the job's own pipeline on a sample of its input here, timing
this machine's start, projected onto the whole input and larger clusters by
`pipeline.estimate` (which holds no click, so the benchmarks measure exactly as this command
does). Nothing heavy is imported until the command runs, so `estimate --help` starts fast."""

from __future__ import annotations

import json
import os
import sys

import click

from pipeline.job_options import set_option


@click.command("estimate")
@click.argument("job_file", type=click.Path(dir_okay=False))
@click.option(
    "--sample",
    type=int,
    default=None,
    help="Input rows to generate here. Default: one block of the job, the rows a replica "
    "takes per call (at most resources.batch_size x 32), decoded as the replica decodes it; "
    "a smaller sample is noisier and ends with its batch draining sooner.",
)
@click.option("--seed", default=0, show_default=True, help="Seed of the row sample.")
@set_option
@click.option("--json", "as_json", is_flag=True, help="Print the projection as JSON (for scripts).")
def estimate_command(
    job_file: str, sample: int, seed: int, overrides: tuple[str, ...], as_json: bool
) -> None:
    """Run JOB_FILE on a sample of its input here and project wall time, GPU-hours and cost
    of the whole input on the job's resources and on larger clusters.

    The sample runs through the job's own pipeline (an embedded Ray, one replica, a
    temporary output), so the projection includes this machine's start: Ray's, and a
    replica's start and model load."""
    from pipeline.ray_auth import prepare_embedded_ray

    if sample is not None and sample < 1:
        raise click.BadParameter("must be at least 1", param_hint="--sample")
    prepare_embedded_ray()  # read by Ray when imported, just below, as submit does
    import pipeline.runner  # noqa: F401  (what submit's driver imports before it runs)
    from pipeline.estimate import (
        estimate_json,
        estimate_report,
        measure_pipeline,
        plan_estimate,
        process_seconds,
        sample_input,
    )
    from pipeline.inputs import plan_input
    from pipeline.job import JobError, load_job

    try:
        job = load_job(job_file, overrides)
        plan = plan_input(job.input)
    except JobError as error:
        raise click.ClickException("\n".join(error.problems)) from error
    driver = process_seconds()  # this process so far: what submit's driver pays to start
    rows, plan = sample_input(job, sample, seed, plan)
    terminal = os.fdopen(os.dup(sys.stderr.fileno()), "w", buffering=1)
    click.echo(
        f"[{job.name}] generating {rows.num_rows} sampled input rows through the job's "
        "pipeline on this machine ...",
        file=terminal,
    )
    try:
        measurement = measure_pipeline(
            job, rows, plan, driver, echo=lambda line: click.echo(line, file=terminal)
        )
    except RuntimeError as error:
        raise click.ClickException(f"the sample run failed: {error}") from error
    if measurement.rates.tokens_per_second <= 0:
        raise click.ClickException("the sample generated no tokens (all rows failed?)")
    estimate = plan_estimate(job, measurement, plan.num_rows)
    if as_json:
        click.echo(json.dumps(estimate_json(estimate), indent=2))
    else:
        click.echo(estimate_report(estimate))
