"""Load a checkpoint directory's tokenizer the way the pipeline and the drafter commands do.

Kept apart from the bundled-asset factory (`spot_factory`), which builds the bundled
tokenizer: a job loads tokenizers, it never builds one.
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
