"""Real checkpoints' configs, parameter-name indexes and tokenizers (no weights), kept in the
repository under tests/reference_checkpoints so that any clone can run the tests that check
names and shapes against the originals."""

from pathlib import Path

ROOT = Path(__file__).resolve().parent / "reference_checkpoints"


def reference_checkpoint(name: str) -> Path:
    """The folder of reference checkpoint `name` (e.g. "sdar-8b-chat")."""
    folder = ROOT / name
    if not folder.is_dir():
        raise FileNotFoundError(f"no reference checkpoint {name!r} in {ROOT}")
    return folder
