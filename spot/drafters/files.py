"""Drafter checkpoints on disk: one safetensors file whose header carries a JSON description
(kind, model config, the target and decoding it was trained on, held-out metrics)."""

from __future__ import annotations

import json
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import save_file

from spot.budget import CURVE_BUDGETS, AcceptanceCurve
from spot.drafters.order_model import OrderModel, OrderModelConfig
from spot.drafters.spot_sets import SetModel, SetModelConfig

_MODELS = {"spot": (OrderModel, OrderModelConfig), "spot-sets": (SetModel, SetModelConfig)}


def save_order_model(path: str | Path, model: OrderModel | SetModel, kind: str, meta: dict) -> None:
    header = {"kind": kind, "config": model.config.to_dict(), **meta}
    tensors = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata={"spot": json.dumps(header)})


def read_header(path: str | Path) -> dict:
    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata() or {}
    if "spot" not in metadata:
        raise ValueError(f"{path} is not a drafter checkpoint of this project")
    return json.loads(metadata["spot"])


def load_order_model(path: str | Path, kind: str = "spot") -> tuple[OrderModel | SetModel, dict]:
    header = read_header(path)
    if header["kind"] != kind:
        raise ValueError(f"{path} holds a {header['kind']!r} drafter, not {kind!r}")
    model_class, config_class = _MODELS[kind]
    model = model_class(config_class(**header["config"]))
    with safe_open(str(path), framework="pt") as f:
        state = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    model.load_state_dict(state)
    return model.eval(), header


def acceptance_curve(kind: str, path: str | Path) -> AcceptanceCurve:
    """Steps per forward by budget, which `drafter.budget: auto` weighs against the forward
    cost: measured after training (SPOT, SPOT-Sets, stored in the header) or predicted by
    Spiffy's calibration counts."""
    if kind == "spiffy":
        from spot.drafters.spiffy import DraftGraph

        graph = DraftGraph.load(path)
        return graph.acceptance_curve([b for b in CURVE_BUDGETS if b <= len(graph.paths)])
    return AcceptanceCurve.from_dict(read_header(path)["acceptance_curve"])


def load_drafter(kind: str, path: str | Path, budget: int, target):
    """The drafter of `kind` ("spot", "spot-sets" or "spiffy") stored at `path`, drafting
    `budget` nodes for `target` (SPOT-Sets reads its token embeddings)."""
    from spot.drafters.spiffy import DraftGraph, SpiffyDrafter
    from spot.drafters.spot import SpotDrafter
    from spot.drafters.spot_sets import SpotSetsDrafter

    if kind == "spot":
        model, _ = load_order_model(path, "spot")
        return SpotDrafter(model, budget=budget)
    if kind == "spot-sets":
        model, _ = load_order_model(path, "spot-sets")
        if model.config.target_hidden_size != target.hidden_size:
            raise ValueError(
                f"{path} was trained for hidden size {model.config.target_hidden_size}, "
                f"the target has {target.hidden_size}"
            )
        return SpotSetsDrafter(model, target.embed, budget=budget)
    if kind == "spiffy":
        graph = DraftGraph.load(path)
        return SpiffyDrafter(graph, budget=budget)
    raise ValueError(f"unknown drafter kind {kind!r}")
