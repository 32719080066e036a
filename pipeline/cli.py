"""`spot-pipeline`: submit, validate and report batch-generation jobs.

Commands are imported only when used, and `--help` lists them from COMMANDS without
importing them, so `--help` and `validate` start fast (neither imports torch or ray). To add
one, write a click command in its own module and name it in COMMANDS with its short help.
"""

from __future__ import annotations

import os
import sys
import traceback

import click

from pipeline.job_options import load_or_exit, or_exit, plan_or_exit, set_option
from spot_common.cli import LazyGroup

COMMANDS = {  # name: (module:attribute, the command's short help, listed by --help)
    "report": (
        "pipeline.report:report_command",
        "Print the summary of OUTPUT_DIR and write plots and an HTML page under it.",
    ),
    "estimate": (
        "pipeline.estimate_command:estimate_command",
        "Run JOB_FILE on a sample of its input here and project wall time, GPU-hours and "
        "cost of the whole input on the job's resources and on larger clusters.",
    ),
    "record-trajectories": (
        "pipeline.drafter_training:record_command",
        "Run the target's own draft-free decoding and store what drafters learn from.",
    ),
    "train-drafter": (
        "pipeline.drafter_training:train_command",
        "Train the SPOT order model (or the SPOT-Sets set model) on recorded trajectories.",
    ),
    "calibrate-spiffy": (
        "pipeline.drafter_training:calibrate_command",
        "Calibrate Spiffy's draft graph on traced draft-free trajectories.",
    ),
    "calibrate-spot": (
        "pipeline.drafter_training:calibrate_spot_command",
        "Choose a trained SPOT checkpoint's tree sharpness by measured acceptance.",
    ),
}


@click.group(
    cls=LazyGroup,
    lazy_commands={name: target for name, (target, _) in COMMANDS.items()},
    summaries={name: summary for name, (_, summary) in COMMANDS.items()},
)
@click.version_option(package_name="spot-pipeline", prog_name="spot-pipeline")
def main() -> None:
    """Lossless speculative decoding (SPOT) for diffusion LMs, as Ray Data batch jobs."""


@click.command()
@click.argument("job_file", type=click.Path(dir_okay=False))
@set_option
def validate(job_file: str, overrides: tuple[str, ...]) -> None:
    """Check JOB_FILE (schema, paths, builtins, input columns) without running it."""
    job = load_or_exit(job_file, overrides)
    plan = plan_or_exit(job, job_file)
    from pipeline.fingerprint import check_resume

    or_exit(f"invalid job {job_file}:", lambda: check_resume(job))
    duplicates = plan.duplicate_ids.num_rows
    click.echo(
        f"ok: {job.name}: {plan.num_rows} rows in {len(plan.files)} file(s), "
        f"{duplicates} duplicated id(s), model {job.model.path}, drafter {job.drafter_label()}, "
        f"output {job.output.path}"
    )
    if plan.unreadable:
        click.echo(f"  {plan.unreadable} row(s) cannot be read: they will be error rows")


@click.command()
@click.argument("job_file", type=click.Path(dir_okay=False))
@set_option
@click.option(
    "--address",
    default=None,
    help="Ray cluster (dashboard address, e.g. http://head:8265) to submit to through the Ray "
    "Jobs API; a cluster with token authentication takes its token from $RAY_AUTH_TOKEN. "
    "Default: $RAY_ADDRESS, else an embedded local Ray private to the run (127.0.0.1 only, "
    "token authentication with a token made for the run).",
)
@click.option("--in-cluster", is_flag=True, hidden=True, help="Run inside a Ray job.")
@click.option(
    "--progress-interval", default=10.0, show_default=True, help="Seconds between progress lines."
)
@click.option(
    "--overwrite",
    is_flag=True,
    help="Delete what output.path holds (rows, summary.json, report) and start again: the way "
    "to reuse an output whose rows were made with other settings. Says what it removed "
    "(part files and rows, counted first), on the terminal and in the run's log.",
)
def submit(
    job_file: str,
    overrides: tuple[str, ...],
    address: str | None,
    in_cluster: bool,
    progress_interval: float,
    overwrite: bool,
) -> None:
    """Run JOB_FILE: generate every row not yet in its output, then write summary.json.

    Submitting again resumes; an output made with other settings (fingerprint.json) is
    refused. What Ray prints goes to the output's logs/ folder; a failure prints one message
    naming that log."""
    job = load_or_exit(job_file, overrides)
    plan = plan_or_exit(job, job_file)
    from pipeline.ray_auth import client_token_from_environment, prepare_embedded_ray
    from pipeline.runlog import failure_reason, run_log

    address = None if in_cluster else address or os.environ.get("RAY_ADDRESS")
    if address:
        client_token_from_environment()
        from pipeline.runner import submit_to_cluster

        command = ("submit", "--overwrite") if overwrite else ("submit",)
        try:  # the cluster checks the output and keeps the log, where it can reach them
            submit_to_cluster(job, address, echo=click.echo, command=command)
        except Exception as error:
            click.echo(f"[{job.name}] failed: {failure_reason(error)}", err=True)
            sys.exit(1)
        return
    if not in_cluster:
        prepare_embedded_ray()  # read by Ray when imported, just below
    from pipeline.fingerprint import claim_output, clearing_removes
    from pipeline.runner import Run, run_job

    removes = (
        or_exit(f"cannot submit {job_file}:", lambda: clearing_removes(job)) if overwrite else None
    )
    output = or_exit(f"cannot submit {job_file}:", lambda: claim_output(job, overwrite))
    ray_address = "auto" if in_cluster else None
    failure: BaseException | None = None
    terminal = sys.stdout
    with run_log(output, "submit") as (log_path, log):

        def echo(line: str) -> None:
            click.echo(line, file=terminal)
            log.write(line + "\n")

        if overwrite:
            removed = f"removed {removes}" if removes else "nothing to remove"
            echo(f"[{job.name}] --overwrite: {removed} in {output.uri} (logs/ kept)")
        bar = terminal if terminal.isatty() else None
        try:
            run_job(
                Run(job, plan, output),
                ray_address=ray_address,
                echo=echo,
                progress_interval=progress_interval,
                progress_bar=bar,
            )
        except (Exception, KeyboardInterrupt) as error:
            log.write(traceback.format_exc())
            failure = error
    if isinstance(failure, KeyboardInterrupt):
        click.echo(f"[{job.name}] interrupted; the rows written are kept", err=True)
        click.echo(f"  the full log: {log_path}", err=True)
        sys.exit(130)
    if failure is not None:
        click.echo(f"[{job.name}] failed: {failure_reason(failure)}", err=True)
        click.echo(f"  the rows written are kept; the full log: {log_path}", err=True)
        sys.exit(1)


main.add_command(submit)
main.add_command(validate)

if __name__ == "__main__":
    main()
