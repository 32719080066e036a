"""The drafter kinds, in one table: what each drafts for, how its file is named and read.

`DRAFTERS["spot"]` answers every question the rest of the project asks about a kind: the
commit rules it serves (`spot.drafters.rules`, which its class declares too), the file name
of a bundled drafter, how to load one for a target and budget, and its acceptance curve
(steps per forward by budget, which `drafter.budget: auto` weighs against the forward cost).
A new kind is one entry here.

Importing this module is cheap: drafter classes and torch are imported when a kind is used.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from spot.config import CommitRule
from spot.drafters.rules import SPIFFY_RULES, SPOT_RULES, SPOT_SETS_RULES

if TYPE_CHECKING:
    from torch import nn

    from spot.budget import AcceptanceCurve
    from spot.drafting import Drafter
    from spot.target import Target


@dataclass(frozen=True)
class DrafterKind:
    """One kind of drafter.

    drafter: its class as "module:Class", imported on first use.
    rules: the commit rules it drafts for (`spot.drafters.rules`: known without importing
      the class, or torch).
    suffix: the extension of its files ("safetensors": a network with a JSON header,
      `spot.drafters.files`; "json": a Spiffy draft graph).
    load: (path, budget, target) -> the drafter stored at path, drafting `budget` nodes.
    curve: path -> its acceptance curve (measured after training, or predicted).
    network: header config -> the untrained network its file holds (None: no network).
    one_token_per_static_step: under the static rule it drafts one commit per step only.
    """

    name: str
    drafter: str
    suffix: str
    load: Callable[[str | Path, int, Target], Drafter]
    curve: Callable[[str | Path], AcceptanceCurve]
    rules: tuple[CommitRule, ...]
    network: Callable[[dict[str, Any]], nn.Module] | None = None
    one_token_per_static_step: bool = False

    @property
    def drafter_class(self) -> type:
        module, name = self.drafter.split(":")
        return getattr(importlib.import_module(module), name)

    def file_name(self, block_length: int, rule: str = CommitRule.STATIC) -> str:
        """File name of a bundled drafter of this kind: one per block length and rule."""
        rule_part = "" if rule == CommitRule.STATIC else f"-{rule}"
        return f"{self.name}-b{block_length}{rule_part}.{self.suffix}"

    def check_file(self, path: str | Path) -> None:
        """Refuse a file that holds another kind's drafter (read from its header alone)."""
        if self.network is not None:
            from spot.drafters.files import check_kind, read_header

            check_kind(read_header(path), path, self.name)

    def load_network(self, path: str | Path) -> tuple[nn.Module, dict]:
        """The trained network of a drafter file of this kind, in eval mode, and its header."""
        from spot.drafters.files import check_kind, read_header, read_tensors

        if self.network is None:
            raise ValueError(f"a {self.name} drafter holds no network")
        header = read_header(path)
        check_kind(header, path, self.name)
        model = self.network(header["config"])
        model.load_state_dict(read_tensors(path))
        return model.eval(), header


def _order_model(config: dict[str, Any]) -> nn.Module:
    from spot.drafters.order_model import OrderModel, OrderModelConfig

    return OrderModel(OrderModelConfig(**config))


def _set_model(config: dict[str, Any]) -> nn.Module:
    from spot.drafters.spot_sets import SetModel, SetModelConfig

    return SetModel(SetModelConfig(**config))


def _load_spot(path: str | Path, budget: int, target: Target) -> Drafter:
    from spot.drafters.spot import SpotDrafter

    model, header = load_order_model(path, "spot")
    return SpotDrafter(model, budget=budget, **header.get("tree", {}))


def _load_spot_sets(path: str | Path, budget: int, target: Target) -> Drafter:
    """SPOT-Sets reads the target's token embeddings: its hidden size must match."""
    from spot.drafters.spot_sets import SpotSetsDrafter

    model, _ = load_order_model(path, "spot-sets")
    if model.config.target_hidden_size != target.hidden_size:
        raise ValueError(
            f"{path} was trained for hidden size {model.config.target_hidden_size}, "
            f"the target has {target.hidden_size}"
        )
    return SpotSetsDrafter(model, target.embed, budget=budget)


def _load_spiffy(path: str | Path, budget: int, target: Target) -> Drafter:
    from spot.drafters.spiffy import DraftGraph, SpiffyDrafter

    return SpiffyDrafter(DraftGraph.load(path), budget=budget)


def _measured_curve(path: str | Path) -> AcceptanceCurve:
    """The curve measured on held-out trajectories after training, stored in the header."""
    from spot.budget import AcceptanceCurve
    from spot.drafters.files import read_header

    return AcceptanceCurve.from_dict(read_header(path)["acceptance_curve"])


def _predicted_curve(path: str | Path) -> AcceptanceCurve:
    """The curve Spiffy's calibration counts predict, up to the graph's size."""
    from spot.budget import CURVE_BUDGETS
    from spot.drafters.spiffy import DraftGraph

    graph = DraftGraph.load(path)
    return graph.acceptance_curve([b for b in CURVE_BUDGETS if b <= len(graph.paths)])


DRAFTERS: dict[str, DrafterKind] = {
    kind.name: kind
    for kind in (
        DrafterKind(
            "spiffy",
            "spot.drafters.spiffy:SpiffyDrafter",
            "json",
            _load_spiffy,
            _predicted_curve,
            rules=SPIFFY_RULES,
            one_token_per_static_step=True,
        ),
        DrafterKind(
            "spot",
            "spot.drafters.spot:SpotDrafter",
            "safetensors",
            _load_spot,
            _measured_curve,
            rules=SPOT_RULES,
            network=_order_model,
        ),
        DrafterKind(
            "spot-sets",
            "spot.drafters.spot_sets:SpotSetsDrafter",
            "safetensors",
            _load_spot_sets,
            _measured_curve,
            rules=SPOT_SETS_RULES,
            network=_set_model,
        ),
    )
}


def drafter_kind(name: str) -> DrafterKind:
    """The registry entry of a kind; a clear error naming the kinds there are."""
    if name not in DRAFTERS:
        raise ValueError(f"unknown drafter kind {name!r} (one of {', '.join(DRAFTERS)})")
    return DRAFTERS[name]


def load_drafter(kind: str, path: str | Path, budget: int, target: Target) -> Drafter:
    """The drafter of `kind` stored at `path`, drafting `budget` nodes for `target`."""
    return drafter_kind(kind).load(path, budget, target)


def acceptance_curve(kind: str, path: str | Path) -> AcceptanceCurve:
    """Steps per forward by budget of the drafter of `kind` stored at `path`."""
    return drafter_kind(kind).curve(path)


def load_order_model(path: str | Path, kind: str = "spot") -> tuple[nn.Module, dict]:
    """The trained network (SPOT's order model, SPOT-Sets' set model) of a `kind` drafter file
    and its header."""
    return drafter_kind(kind).load_network(path)
