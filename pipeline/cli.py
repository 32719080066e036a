"""`spot-pipeline`: submit, validate and report batch-generation jobs.

Commands are imported only when used, and `--help` lists them from COMMANDS without
importing them, so `--help` and `validate` start fast (neither imports torch or ray). To add
one, write a click command in its own module and name it in COMMANDS with its short help.
"""

from __future__ import annotations

import _thread
import os
import sys
import traceback

import click

from pipeline.job_options import (
    exits_on_job_error,
    load_or_exit,
    or_exit,
    plan_or_exit,
    set_option,
)
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
    from pipeline.fingerprint import check_output

    notes = or_exit(f"invalid job {job_file}:", lambda: check_output(job, plan))
    duplicates = plan.duplicate_ids.num_rows
    learning = " (learning from it)" if job.drafter.learn else ""
    click.echo(
        f"ok: {job.name}: {plan.num_rows} rows in {len(plan.files)} file(s), "
        f"{duplicates} duplicated id(s), model {job.model.path}, drafter "
        f"{job.drafter_label()}{learning}, "
        f"output {job.output.path}"
    )
    if plan.unreadable:
        click.echo(f"  {plan.unreadable} row(s) cannot be read: they will be error rows")
    for note in notes:
        click.echo(f"  {note}")


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
@click.option(
    "--extend",
    is_flag=True,
    help="Accept an input that grew since the output's last submit (rows added to its files, "
    "or files added) and generate its new rows; every row already written must still match "
    "it.",
)
@click.option(
    "--no-retry-failed",
    "retry_failed",
    flag_value=False,
    default=True,
    help="Keep the rows whose generation failed instead of generating them again (rows whose "
    "input is at fault are never retried).",
)
def submit(
    job_file: str,
    overrides: tuple[str, ...],
    address: str | None,
    in_cluster: bool,
    progress_interval: float,
    overwrite: bool,
    extend: bool,
    retry_failed: bool,
) -> None:
    """Run JOB_FILE: generate every row not yet in its output, then write summary.json.

    Submitting again resumes; an output made with other settings (fingerprint.json) is
    refused. What Ray prints goes to the output's logs/ folder; a failure prints one message
    naming that log."""
    job = load_or_exit(job_file, overrides)
    plan = plan_or_exit(job, job_file)
    from pipeline.ray_auth import client_token_from_environment, prepare_embedded_ray
    from pipeline.runlog import failure_reason

    address = None if in_cluster else address or os.environ.get("RAY_ADDRESS")
    if address:
        client_token_from_environment()
        from pipeline.runner import submit_to_cluster

        flags = {
            "--overwrite": overwrite,
            "--extend": extend,
            "--no-retry-failed": not retry_failed,
        }
        command = ("submit", *(flag for flag, given in flags.items() if given))
        try:  # the cluster checks the output and keeps the log, where it can reach them
            submit_to_cluster(job, address, echo=click.echo, command=command)
        except Exception as error:
            click.echo(f"[{job.name}] failed: {failure_reason(error)}", err=True)
            sys.exit(1)
        return
    if not in_cluster:
        prepare_embedded_ray()  # read by Ray when imported, below
    from pipeline.fingerprint import clearing_removes

    removes = (
        or_exit(f"cannot submit {job_file}:", lambda: clearing_removes(job)) if overwrite else None
    )
    options = {"overwrite": overwrite, "extend": extend, "retry_failed": retry_failed}

    def run(ray_address: str | None) -> None:
        _run(job, job_file, plan, ray_address, progress_interval, options, removes)

    if in_cluster:
        run("auto")
    elif not _writes_to_descriptors():  # a forked driver's lines would be lost: run here
        run(None)
    else:  # the embedded Ray's processes out of reach of signals to this command's group
        from pipeline.session import own_session

        own_session(lambda: run(None))


def _writes_to_descriptors() -> bool:
    """Standard output and error are files a child process shares (not an in-memory buffer,
    as under click's test runner or a notebook)."""
    try:
        sys.stdout.fileno()
        sys.stderr.fileno()
    except (OSError, ValueError, AttributeError):
        return False
    return True


def _run(
    job,
    job_file: str,
    plan,
    ray_address: str | None,
    progress_interval: float,
    options: dict[str, bool],
    removes: str | None,
) -> None:
    """`submit`'s run, in the driver's process: it holds the output (`pipeline.claim`), says
    its lines on the terminal and in the run's log, exits 1 on a failure and 128 + the signal
    when a signal stopped it. `options`: hold_output's overwrite, extend and retry_failed;
    `removes`: what --overwrite deletes, counted before."""
    from pipeline.claim import hold_output
    from pipeline.control import RunInterrupted
    from pipeline.runlog import failure_reason, run_log
    from pipeline.runner import run_job

    def lease_lost(message: str) -> None:  # from the heartbeat thread: stop the run
        click.echo(f"[{job.name}] {message}; stopping", err=True)
        _thread.interrupt_main()

    failure: BaseException | None = None
    terminal = sys.stdout
    held = hold_output(job, plan, **options, echo=click.echo, on_lost=lease_lost)
    with (
        exits_on_job_error(f"cannot submit {job_file}:"),
        held as run,
        run_log(run.output, "submit") as (log_path, log),
    ):

        def echo(line: str) -> None:
            click.echo(line, file=terminal)
            log.write(line + "\n")

        if options["overwrite"]:
            removed = f"removed {removes}" if removes else "nothing to remove"
            echo(f"[{job.name}] --overwrite: {removed} in {run.output.uri} (logs/ kept)")
        bar = terminal if terminal.isatty() else None
        try:
            run_job(
                run,
                ray_address=ray_address,
                echo=echo,
                progress_interval=progress_interval,
                progress_bar=bar,
            )
        except RunInterrupted as error:
            log.write(error.summary + "\n")
            failure = error
        except (Exception, KeyboardInterrupt) as error:
            log.write(traceback.format_exc())
            failure = error
    if isinstance(failure, RunInterrupted):
        click.echo(failure.summary, err=True)
        sys.exit(failure.exit_code)
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
