"""Checkpoints named by a Hugging Face hub id (`org/name`): the one place that tells a hub id
from a local path, finds its snapshot in the local cache, or downloads it.

Imports nothing heavy, so a job is validated without torch; no remote code is ever run.
"""

from __future__ import annotations

import threading
from pathlib import Path

# what a checkpoint directory needs: configs, weights, tokenizer files, chat template
CHECKPOINT_FILES = ["*.json", "*.safetensors", "*.txt", "*.jinja", "*.model", "*.tiktoken"]
HUB_TIMEOUT = 10.0  # seconds the hub has to answer whether it holds a checkpoint


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


def hub_problem(hub_id: str, timeout: float = HUB_TIMEOUT) -> str | None:
    """Why a hub checkpoint that is not cached cannot be downloaded from here (offline, no
    such model, gated, no answer within `timeout` seconds), None when the hub lists it."""
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    missing = f"{hub_id!r} is not in the local Hugging Face cache and"
    way_out = "download it first, or give a local checkpoint directory"
    if constants.HF_HUB_OFFLINE:
        return f"{missing} HF_HUB_OFFLINE is set; {way_out}"
    answers: list[BaseException | None] = []

    def ask() -> None:
        try:
            HfApi().model_info(hub_id, timeout=timeout)
            answers.append(None)
        except Exception as error:
            answers.append(error)

    asking = threading.Thread(target=ask, daemon=True)  # a name lookup may ignore timeouts
    asking.start()
    asking.join(timeout)
    if not answers:
        return f"{missing} the hub did not answer within {timeout:g} s; {way_out}"
    error = answers[0]
    if error is None:
        return None
    if isinstance(error, GatedRepoError):
        return f"{hub_id!r} is gated on the hub: accept its terms there and set HF_TOKEN"
    if isinstance(error, RepositoryNotFoundError):
        return f"the hub has no model {hub_id!r} (a private one needs HF_TOKEN)"
    reason = (str(error).splitlines() or [""])[0][:200]
    return f"{missing} the hub cannot be reached ({type(error).__name__}: {reason}); {way_out}"


def download(hub_id: str) -> Path:
    """The hub checkpoint's files in the Hugging Face cache, downloaded if missing."""
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(repo_id=hub_id, allow_patterns=CHECKPOINT_FILES))
