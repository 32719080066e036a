"""`spot-pipeline estimate`: the job's engine on a sample of its input here, projected onto
the whole input and larger clusters by `pipeline.estimate` (which holds no click, so the
benchmarks measure an engine exactly as this command does)."""

from __future__ import annotations

import json

import click

from pipeline.estimate import (
    block_rows,
    estimate_json,
    estimate_report,
    measure,
    plan_estimate,
    sample_rows,
)
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
    of the whole input on the job's resources and on larger clusters."""
    from pipeline.job import JobError, load_job

    if sample is not None and sample < 1:
        raise click.BadParameter("must be at least 1", param_hint="--sample")
    try:
        job = load_job(job_file, overrides)
        rows, input_rows = sample_rows(job, sample, seed)
    except JobError as error:
        raise click.ClickException("\n".join(error.problems)) from error
    click.echo(
        f"[{job.name}] generating {rows.num_rows} sampled rows on this machine ...", err=as_json
    )
    measurement = measure(job, rows, block_rows(job, input_rows))
    if measurement.rates.tokens_per_second <= 0:
        raise click.ClickException("the sample generated no tokens (all rows failed?)")
    estimate = plan_estimate(job, measurement, input_rows)
    if as_json:
        click.echo(json.dumps(estimate_json(estimate), indent=2))
    else:
        click.echo(estimate_report(estimate))
