"""The target families by name: the module that implements each and the config.json
`model_type` values it reads. Standard library only, so a job is checked against a
checkpoint (`pipeline.job`) without importing torch or the families themselves; a family
module registers its implementation with `spot.models.registry`, which imports it from here.
A new family adds its line here."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class IndexedFamily:
    module: str  # the module that registers the family when imported
    model_types: tuple[str, ...]  # config.json `model_type` values it reads


FAMILY_INDEX = {
    "sdar": IndexedFamily("spot.models.sdar", ("sdar",)),
    "llada": IndexedFamily("spot.models.llada", ("llada",)),
    "dream": IndexedFamily("spot.models.dream", ("Dream",)),
    "llada2": IndexedFamily("spot.models.llada2", ("llada2_moe",)),
}


def family_reading(model_type: object) -> str | None:
    """The family whose checkpoints declare `model_type`, or None."""
    return next((name for name, f in FAMILY_INDEX.items() if model_type in f.model_types), None)
