"""Checkpoints named by a Hugging Face hub id (`org/name`): the one place that tells a hub id
from a local path, finds its snapshot in the local cache, or downloads it.

Imports nothing heavy, so a job is validated without torch; no remote code is ever run.
"""

from __future__ import annotations

from pathlib import Path

# what a checkpoint directory needs: configs, weights, tokenizer files, chat template
CHECKPOINT_FILES = ["*.json", "*.safetensors", "*.txt", "*.jinja", "*.model", "*.tiktoken"]


def is_hub_id(name: str | Path) -> bool:
    """Whether `name` has the form of a hub id: two non-empty parts, not a relative or home
    path (a local directory of that name is looked for first by the callers)."""
    name = str(name)
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not name.startswith((".", "~"))


def cached_snapshot(hub_id: str) -> Path | None:
    """The local snapshot of a hub checkpoint when the Hugging Face cache holds one."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id=hub_id, local_files_only=True))
    except LocalEntryNotFoundError:
        return None


def download(hub_id: str) -> Path:
    """The hub checkpoint's files in the Hugging Face cache, downloaded if missing."""
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(repo_id=hub_id, allow_patterns=CHECKPOINT_FILES))
