"""Drafter checkpoints on disk: one safetensors file whose header carries a JSON description
(kind, model config, the target and decoding it was trained on, held-out metrics)."""

from __future__ import annotations

import json
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import save_file

from spot.drafters.order_model import OrderModel, OrderModelConfig


def save_order_model(path: str | Path, model: OrderModel, kind: str, meta: dict) -> None:
    header = {"kind": kind, "config": model.config.to_dict(), **meta}
    tensors = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    save_file(tensors, str(path), metadata={"spot": json.dumps(header)})


def read_header(path: str | Path) -> dict:
    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata() or {}
    if "spot" not in metadata:
        raise ValueError(f"{path} is not a drafter checkpoint of this project")
    return json.loads(metadata["spot"])


def load_order_model(path: str | Path, kind: str = "spot") -> tuple[OrderModel, dict]:
    header = read_header(path)
    if header["kind"] != kind:
        raise ValueError(f"{path} holds a {header['kind']!r} drafter, not {kind!r}")
    model = OrderModel(OrderModelConfig(**header["config"]))
    with safe_open(str(path), framework="pt") as f:
        state = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    model.load_state_dict(state)
    return model.eval(), header


def load_drafter(kind: str, path: str | Path, budget: int):
    """The drafter of `kind` ("spot" or "spiffy") stored at `path`, drafting `budget` nodes."""
    from spot.drafters.spiffy import DraftGraph, SpiffyDrafter
    from spot.drafters.spot import SpotDrafter

    if kind == "spot":
        model, _ = load_order_model(path, "spot")
        return SpotDrafter(model, budget=budget)
    if kind == "spiffy":
        graph = DraftGraph.load(path)
        return SpiffyDrafter(graph, keep=budget if budget < len(graph.paths) else None)
    raise ValueError(f"unknown drafter kind {kind!r}")
