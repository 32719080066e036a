"""Drafter checkpoints on disk: one safetensors file whose header carries a JSON description
(kind, network config, the target and decoding it was trained on, held-out metrics). Which
network a kind's file holds is the registry's business (`registry.load_order_model`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from safetensors import safe_open

if TYPE_CHECKING:
    import torch
    from torch import nn


def save_order_model(path: str | Path, model: nn.Module, kind: str, meta: dict) -> None:
    """Write a drafter network of `kind` (its config in the header, with `meta`)."""
    from safetensors.torch import save_file

    header = {"kind": kind, "config": model.config.to_dict(), **meta}
    tensors = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata={"spot": json.dumps(header)})


def read_header(path: str | Path) -> dict:
    """The JSON description in the file's header (read without torch: a job's drafter is
    checked before anything imports it)."""
    with safe_open(str(path), framework="numpy") as f:
        metadata = f.metadata() or {}
    if "spot" not in metadata:
        raise ValueError(f"{path} is not a drafter checkpoint of this project")
    return json.loads(metadata["spot"])


def check_kind(header: dict, path: str | Path, kind: str) -> None:
    if header["kind"] != kind:
        raise ValueError(f"{path} holds a {header['kind']!r} drafter, not {kind!r}")


def read_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    """The network's state dict as stored."""
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
