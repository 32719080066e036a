"""`spot-factory`: build the bundled corpus and tokenizer, train the bundled targets and
measure their draft-free quality.

    spot-factory build-corpus --output build/corpus
    spot-factory train-target sdar-nano --output build/targets/sdar-nano
    spot-factory evaluate-target build/targets/sdar-nano

Commands that write take --output DIR, or --into-package to replace the bundled files in
spot/builtin (what scripts/train_bundled_targets.sh does).
"""

from __future__ import annotations

from pathlib import Path

import click

from spot_common.cli import LazyGroup

COMMANDS = {
    "build-corpus": "spot_factory.tokenizer:build_corpus_command",
    "train-target": "spot_factory.train_target:train_target_command",
    "evaluate-target": "spot_factory.target_quality:evaluate_target_command",
}


def output_options(command):
    """--output DIR or --into-package, one of them required: a factory command rewrites the
    installed package's assets only when told to."""
    command = click.option(
        "--into-package",
        is_flag=True,
        help="write into the installed package (spot/builtin), replacing the bundled files",
    )(command)
    return click.option(
        "--output", type=click.Path(file_okay=False, path_type=Path), help="directory to write"
    )(command)


def chosen_output(output: Path | None, into_package: bool, packaged: Path) -> Path:
    """The directory a command writes: --output, or `packaged` with --into-package."""
    if output is not None and into_package:
        raise click.UsageError("give --output DIR or --into-package, not both")
    if output is None and not into_package:
        raise click.UsageError(
            f"give --output DIR, or --into-package to replace the bundled files in {packaged}"
        )
    return packaged if into_package else output


@click.group(cls=LazyGroup, lazy_commands=COMMANDS)
@click.version_option(package_name="spot-pipeline", prog_name="spot-factory")
def main() -> None:
    """Make and check the bundled assets (corpus, tokenizer, targets) of spot-pipeline."""


if __name__ == "__main__":
    main()
