"""Real checkpoints' configs, parameter-name indexes and tokenizers (no weights), which the
tests read to check names and shapes against the originals. They lie in
`shared/reference-checkpoints` beside the checkout, or where $SPOT_REFERENCE_CHECKPOINTS
points."""

import os
from pathlib import Path

BESIDE_CHECKOUT = Path(__file__).resolve().parents[2] / "shared" / "reference-checkpoints"


def reference_checkpoint(name: str) -> Path:
    """The folder of reference checkpoint `name` (e.g. "sdar-8b-chat")."""
    root = Path(os.environ.get("SPOT_REFERENCE_CHECKPOINTS") or BESIDE_CHECKOUT)
    folder = root / name
    if not folder.is_dir():
        raise FileNotFoundError(
            f"reference checkpoint {name!r} not found in {root}: check out the project beside "
            "shared/, or set SPOT_REFERENCE_CHECKPOINTS to the reference-checkpoints folder"
        )
    return folder
