"""Load a checkpoint directory's tokenizer the way the pipeline, the drafter commands and the
asset factory's evaluation do (the factory also builds the bundled tokenizer; loading one
needs nothing of that).
"""

from __future__ import annotations

from pathlib import Path


def load_tokenizer(directory: str | Path):
    """A checkpoint directory's tokenizer, of the class its tokenizer_config.json names.

    AutoTokenizer otherwise reads config.json to find that class; transformers does not know
    the DLM families' model types (sdar, llada), so every load warned that the checkpoint
    might not fit the model and that its `rope_scaling` key is deprecated."""
    from transformers import AutoTokenizer, PreTrainedConfig

    return AutoTokenizer.from_pretrained(
        directory, config=PreTrainedConfig(), local_files_only=True
    )
