"""Checkpoints in their original on-disk format: read, write, turn into a target.

A checkpoint directory holds the family's own `config.json`, `generation_config.json` and
safetensors weights under the original parameter names (one `model.safetensors` or shards
listed in `model.safetensors.index.json`). No remote code runs: the family maps names and
config keys onto the native transformer. A hub id is downloaded first.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from spot.models import hub
from spot.models.registry import Decoding, Family, family_for
from spot.models.target import DiffusionTarget
from spot.models.transformer import Transformer

# the dtypes a target may run in, by the name job files and specs give them
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}
INDEX_FILE = "model.safetensors.index.json"
WEIGHTS_FILE = "model.safetensors"


@dataclass
class LoadedModel:
    model: Transformer
    family: Family
    decoding: Decoding
    raw_config: dict[str, Any]
    path: Path


def resolve_checkpoint(path_or_hub_id: str | Path) -> Path:
    """A local checkpoint directory; a hub id (`org/name`) is downloaded to the HF cache."""
    path = Path(path_or_hub_id).expanduser()
    if path.is_dir():
        return path
    name = str(path_or_hub_id)
    if not hub.is_hub_id(name):
        raise FileNotFoundError(f"no checkpoint directory at {name}")
    return hub.download(name)


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def _token_ids(directory: Path, tokens: tuple[str, ...]) -> tuple[int, ...]:
    """Ids of special tokens named in tokenizer_config.json (those it lists)."""
    added = _read_json(directory / "tokenizer_config.json").get("added_tokens_decoder", {})
    by_content = {entry["content"]: int(i) for i, entry in added.items()}
    return tuple(by_content[t] for t in tokens if t in by_content)


def _weight_files(directory: Path) -> dict[str, Path]:
    """Original parameter name -> file holding it."""
    index = directory / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: directory / file for name, file in weight_map.items()}
    single = directory / WEIGHTS_FILE
    if not single.is_file():
        raise FileNotFoundError(f"no {WEIGHTS_FILE} or {INDEX_FILE} in {directory}")
    with safe_open(single, framework="pt") as f:
        return {name: single for name in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)


def load_model(
    path_or_hub_id: str | Path,
    family: str | None = None,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
) -> LoadedModel:
    """The native model of a checkpoint, weights under their original names.

    dtype None keeps the stored dtype. On the meta device nothing is read but names and
    shapes: the checkpoint's parameter list (from the index, or the safetensors headers)
    must map exactly onto the native parameters.
    """
    directory = resolve_checkpoint(path_or_hub_id)
    raw = _read_json(directory / "config.json")
    if not raw:
        raise FileNotFoundError(f"no config.json in {directory}")
    fam = family_for(family, raw)
    config = fam.native_config(raw)
    generation = _read_json(directory / "generation_config.json")
    decoding = fam.decoding(raw, generation, _token_ids(directory, fam.extra_eos_tokens()))
    device = torch.device(device)
    with torch.device("meta"):
        model = fam.build(config)
    files = _weight_files(directory)
    expected = original_shapes(fam, model)
    if device.type == "meta":
        stored = {name: _stored_shape(file, name) for name, file in files.items()}
        _check_names(fam, expected, stored)
        if dtype is not None:
            model = model.to(dtype)
        return LoadedModel(model.eval(), fam, decoding, raw, directory)
    state = {}
    by_file: dict[Path, list[str]] = {}
    for name, file in files.items():
        by_file.setdefault(file, []).append(name)
    for file, names in by_file.items():
        with safe_open(file, framework="pt", device=str(device)) as f:
            for name in names:
                tensor = f.get_tensor(name)
                # a copy owns aligned memory: kernels may round differently on the
                # unaligned views of a memory-mapped file
                state[name] = tensor.to(dtype or tensor.dtype, copy=True)
    _check_names(fam, expected, {n: tuple(t.shape) for n, t in state.items()})
    native = fam.to_native(state)
    if config.tie_word_embeddings:
        native.pop("lm_head.weight", None)
    model.load_state_dict(native, strict=not config.tie_word_embeddings, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return LoadedModel(model.eval(), fam, decoding, raw, directory)


def load_target(
    path_or_hub_id: str | Path,
    family: str | None = None,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
) -> DiffusionTarget:
    """A decode-ready target from a checkpoint directory or hub id (family from
    config.json's model_type unless given)."""
    loaded = load_model(path_or_hub_id, family, dtype, device)
    return DiffusionTarget(loaded.model, loaded.decoding)


def save_checkpoint(
    directory: str | Path,
    family: Family,
    model: Transformer,
    mask_id: int,
    eos_ids: tuple[int, ...],
    extra_config: dict[str, Any] | None = None,
) -> Path:
    """Write `model` in the family's original format: config.json (original keys, updated
    by `extra_config`), generation_config.json and model.safetensors (original names)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = model.config
    native = {name: t.detach() for name, t in model.state_dict().items()}
    if config.tie_word_embeddings:
        native.pop("lm_head.weight")
    state = {
        name: t.to("cpu").contiguous().clone() for name, t in family.to_original(native).items()
    }
    raw = family.original_config(config, mask_id, tuple(eos_ids))
    raw["torch_dtype"] = str(next(iter(state.values())).dtype).removeprefix("torch.")
    raw.update(extra_config or {})
    save_file(state, str(directory / WEIGHTS_FILE), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")
    generation = family.generation_config(tuple(eos_ids))
    (directory / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    return directory


def original_shapes(family: Family, model: Transformer) -> dict[str, tuple[int, ...]]:
    """Original parameter names and shapes the native model corresponds to."""
    native = {
        name: torch.empty(t.shape, device="meta", dtype=t.dtype)
        for name, t in model.state_dict().items()
    }
    if model.config.tie_word_embeddings:
        native.pop("lm_head.weight")
    return {name: tuple(t.shape) for name, t in family.to_original(native).items()}


def _stored_shape(file: Path, name: str) -> tuple[int, ...] | None:
    """A stored tensor's shape from its safetensors header, None if the file is absent."""
    if not file.is_file():
        return None
    with safe_open(file, framework="pt") as f:
        return tuple(f.get_slice(name).get_shape())


def _check_names(
    family: Family,
    expected: dict[str, tuple[int, ...]],
    stored: dict[str, tuple[int, ...] | None],
) -> None:
    """The stored names must be exactly those the native parameters map to, with the
    native shapes wherever the stored shape is known."""
    missing = sorted(set(expected) - set(stored))
    unexpected = sorted(set(stored) - set(expected))
    if missing or unexpected:
        raise ValueError(
            f"{family.name} checkpoint does not match the native model: "
            f"missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
            f"unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}"
        )
    wrong = [
        f"{name}: stored {shape}, native {expected[name]}"
        for name, shape in stored.items()
        if shape is not None and shape != expected[name]
    ]
    if wrong:
        raise ValueError(f"{family.name} checkpoint shapes differ: {wrong[:5]}")
