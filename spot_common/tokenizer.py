"""Load a checkpoint directory's tokenizer the way the pipeline, the drafter commands and the
asset factory's evaluation do (the factory also builds the bundled tokenizer; loading one
needs nothing of that).
"""

from __future__ import annotations

import json
from pathlib import Path


def load_tokenizer(directory: str | Path):
    """A checkpoint directory's tokenizer, of the class its tokenizer_config.json names.

    The class is taken from transformers by that name, as AutoTokenizer would take it:
    AutoTokenizer imports transformers' configuration classes, and with them torch, which
    the pipeline's text stages otherwise never load; and it reads config.json to find the
    class, where transformers does not know the DLM families' model types (sdar, llada), so
    every load warned that the checkpoint might not fit the model. A directory whose config
    names no class transformers has goes through AutoTokenizer."""
    import transformers

    config = Path(directory) / "tokenizer_config.json"
    name = json.loads(config.read_text()).get("tokenizer_class") if config.is_file() else None
    tokenizer_class = getattr(transformers, name, None) if isinstance(name, str) else None
    if tokenizer_class is not None:
        return tokenizer_class.from_pretrained(directory, local_files_only=True)
    return transformers.AutoTokenizer.from_pretrained(
        directory, config=transformers.PreTrainedConfig(), local_files_only=True
    )
