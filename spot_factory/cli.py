"""`spot-factory`: build the bundled corpus and tokenizer, train the bundled targets and
measure their draft-free quality.

    spot-factory build-corpus --output build/corpus
    spot-factory train-target sdar-nano --output build/targets/sdar-nano
    spot-factory evaluate-target build/targets/sdar-nano
"""

from __future__ import annotations

import click

from pipeline.cli import LazyGroup

COMMANDS = {
    "build-corpus": "spot_factory.tokenizer:build_corpus_command",
    "train-target": "spot_factory.train_target:train_target_command",
    "evaluate-target": "spot_factory.target_quality:evaluate_target_command",
}


@click.group(cls=LazyGroup, lazy_commands=COMMANDS)
@click.version_option(package_name="spot-pipeline")
def main() -> None:
    """Make and check the bundled assets (corpus, tokenizer, targets) of spot-pipeline."""


if __name__ == "__main__":
    main()
