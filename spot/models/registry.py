"""Target families: how each original checkpoint format maps onto the native transformer.

A family knows its original `config.json` keys and safetensors parameter names (both ways),
its special tokens and how it decodes (attention regime, block grid, confidence, logit
shift). Family modules register themselves here; `family_for` picks one by name or by the
checkpoint's `model_type`.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from spot.config import ConfidenceName
from spot.models.family_index import FAMILY_INDEX
from spot.models.transformer import Transformer, TransformerConfig

NO_PREFIX_CACHE_BIDIRECTIONAL = (
    "bidirectional attention (LLaDA, Dream): a prompt's keys and values depend on every "
    "token after it, so no prefix cache is exact"
)


def prefix_cache_problem(block_causal: bool) -> str | None:
    """Why a target of this attention regime cannot take a prefix cache; None: it can."""
    return None if block_causal else NO_PREFIX_CACHE_BIDIRECTIONAL


@dataclass(frozen=True)
class Decoding:
    """How a family's checkpoint decodes (what the target wrapper needs beyond weights)."""

    mask_id: int
    eos_ids: tuple[int, ...]
    confidence: ConfidenceName  # the family's own confidence at T>0
    block_causal: bool  # exact KV cache of committed blocks; else bidirectional, no cache
    absolute_block_grid: bool  # blocks aligned to position 0, else to the prompt end
    logit_shift: bool  # hidden state i-1 predicts token i (Dream)
    max_length: int
    opening_commit: bool = False  # a block's first step commits its first position (Dream)

    def __post_init__(self) -> None:
        if self.block_causal and not self.absolute_block_grid:
            raise ValueError("a block-causal target needs the absolute block grid")
        if self.block_causal and self.logit_shift:
            raise ValueError("a block-causal target cannot shift logits")
        if not self.eos_ids:
            raise ValueError("a target needs at least one EOS id")


class Renames:
    """One-to-one renames of parameters between a family's original names and the native
    ones, both ways: (original, native) prefixes with the layer index written {i}. A name no
    pair renames is kept when the layouts share it (`keep_others`), else refused."""

    def __init__(self, family: str, pairs: Sequence[tuple[str, str]], keep_others: bool):
        self.family = family
        self.keep_others = keep_others
        self._to_native = self._rules(pairs, forward=True)
        self._to_original = self._rules(pairs, forward=False)

    @staticmethod
    def _rules(pairs, forward: bool) -> list[tuple[re.Pattern[str], str]]:
        rules = []
        for original, native in pairs:
            src, dst = (original, native) if forward else (native, original)
            pattern = re.escape(src).replace(re.escape("{i}"), r"(\d+)")
            rules.append((re.compile("^" + pattern), dst.replace("{i}", r"\1")))
        return rules

    def to_native(self, name: str) -> str:
        return self._rename(name, self._to_native)

    def to_original(self, name: str) -> str:
        return self._rename(name, self._to_original)

    def _rename(self, name: str, rules: list[tuple[re.Pattern[str], str]]) -> str:
        """Renamed by the first matching rule."""
        for pattern, replacement in rules:
            renamed, count = pattern.subn(replacement, name)
            if count:
                return renamed
        if self.keep_others:
            return name
        raise KeyError(f"unexpected {self.family} parameter {name!r}")


class Family:
    """Base class of a checkpoint family. Subclasses set the class attributes and implement
    the config and name mappings; parameter names default to the native (Qwen) ones."""

    name: str  # registry key and the `model_type` it writes
    title: str  # how messages name it
    architectures: tuple[str, ...]  # config.json `architectures` it writes
    confidence: ConfidenceName
    block_causal: bool
    absolute_block_grid: bool
    logit_shift: bool = False
    opening_commit: bool = False
    # the native traits of a model of this family trained from scratch (the asset factory's
    # small ones), beside the shape the factory chooses; None: none is trained here
    fresh_traits: Mapping[str, Any] | None = None
    # config.json's mask id and length, and their values where the published configs omit
    # them (None: the key is required)
    default_mask_id: int | None = None
    max_length_key: str = "max_position_embeddings"
    default_max_length: int | None = None

    @property
    def model_types(self) -> tuple[str, ...]:
        """config.json `model_type` values it reads (`spot.models.family_index`)."""
        return FAMILY_INDEX[self.name].model_types

    # -- config.json ------------------------------------------------------------------------
    def native_config(self, raw: Mapping[str, Any]) -> TransformerConfig:
        """The native architecture described by an original config.json."""
        raise NotImplementedError

    def original_config(
        self, config: TransformerConfig, mask_id: int, eos_ids: tuple[int, ...]
    ) -> dict[str, Any]:
        """An original-format config.json for a native architecture (inverse of
        `native_config`, with the family's other keys at their published values)."""
        raise NotImplementedError

    def mask_id(self, raw: Mapping[str, Any]) -> int:
        if self.default_mask_id is None:
            return int(raw["mask_token_id"])
        return int(raw.get("mask_token_id", self.default_mask_id))

    def max_length(self, raw: Mapping[str, Any]) -> int:
        if self.default_max_length is None:
            return int(raw[self.max_length_key])
        return int(raw.get(self.max_length_key, self.default_max_length))

    def check_fixed(self, raw: Mapping[str, Any], fixed: Mapping[str, Any]) -> None:
        """Refuse a config.json key holding another value than the one the native model
        implements (a key left out is fine)."""
        for key, value in fixed.items():
            if raw.get(key, value) != value:
                raise ValueError(
                    f"{self.title} {key}={raw[key]!r} is not supported (needs {value!r})"
                )

    def check_default_rope(self, raw: Mapping[str, Any]) -> None:
        if raw.get("rope_scaling"):
            raise ValueError(f"{self.title} rope_scaling is not supported (only the default rope)")

    def check_qwen_options(self, raw: Mapping[str, Any]) -> None:
        """Refuse the Qwen config options the native model implements only at their
        defaults: rope scaling, sliding-window attention, an activation other than SiLU."""
        self.check_default_rope(raw)
        if raw.get("use_sliding_window"):
            raise ValueError(f"{self.title} sliding-window attention is not supported")
        if raw.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{self.title} hidden_act {raw['hidden_act']!r} is not supported")

    # -- model and parameter names -----------------------------------------------------------
    def build(self, config: TransformerConfig) -> Transformer:
        """A native model with this family's layers (override for a custom MLP)."""
        return Transformer(config)

    def to_native(self, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Original parameter names (and layouts) -> native state dict."""
        return dict(state)

    def to_original(self, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Native state dict -> original parameter names (and layouts)."""
        return dict(state)

    # -- decoding -----------------------------------------------------------------------------
    def decoding(
        self, raw: Mapping[str, Any], generation: Mapping[str, Any], extra_eos: tuple[int, ...]
    ) -> Decoding:
        """Decoding traits from config.json, generation_config.json and EOS ids the family
        reads from tokenizer files (`extra_eos`)."""
        eos = generation.get("eos_token_id", raw.get("eos_token_id"))
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        eos_ids += tuple(i for i in extra_eos if i not in eos_ids)
        return Decoding(
            mask_id=self.mask_id(raw),
            eos_ids=tuple(int(i) for i in eos_ids),
            confidence=self.confidence,
            block_causal=self.block_causal,
            absolute_block_grid=self.absolute_block_grid,
            logit_shift=self.logit_shift,
            max_length=self.max_length(raw),
            opening_commit=self.opening_commit,
        )

    def extra_eos_tokens(self) -> tuple[str, ...]:
        """Token strings that also end a generation, looked up in tokenizer files."""
        return ()

    def generation_config(self, eos_ids: tuple[int, ...]) -> dict[str, Any]:
        """generation_config.json written with a checkpoint."""
        return {"eos_token_id": list(eos_ids) if len(eos_ids) > 1 else eos_ids[0]}

    # -- a model trained from scratch ---------------------------------------------------------
    def fresh_config(self, **shape: Any) -> TransformerConfig:
        """The native architecture of a model of this family trained from scratch: `shape`
        (sizes, rope theta, tying, positions) with the family's `fresh_traits`."""
        if self.fresh_traits is None:
            raise ValueError(f"no {self.name} model is trained from scratch here")
        return TransformerConfig(**shape, **self.fresh_traits)

    def chat_eos_ids(self, end_of_text: int, end_of_turn: int) -> tuple[int, ...]:
        """The EOS ids a chat checkpoint of this family lists, in the family's order."""
        return (end_of_text, end_of_turn)


_FAMILIES: dict[str, Family] = {}


def register(family: Family) -> Family:
    if family.name not in FAMILY_INDEX:
        raise ValueError(f"family {family.name!r} is not in spot.models.family_index")
    if family.name in _FAMILIES:
        raise ValueError(f"family {family.name!r} registered twice")
    _FAMILIES[family.name] = family
    return family


def _load_builtin() -> None:
    for family in FAMILY_INDEX.values():
        importlib.import_module(family.module)


def families() -> dict[str, Family]:
    _load_builtin()
    return dict(_FAMILIES)


def family_for(name: str | None = None, raw_config: Mapping[str, Any] | None = None) -> Family:
    """The family called `name`, or the one whose model_type the config declares."""
    known = families()
    if name is not None:
        if name not in known:
            raise ValueError(f"unknown target family {name!r}; known: {sorted(known)}")
        return known[name]
    model_type = (raw_config or {}).get("model_type")
    for family in known.values():
        if model_type in family.model_types:
            return family
    raise ValueError(
        f"config.json model_type {model_type!r} is not a known target family "
        f"({sorted(t for f in known.values() for t in f.model_types)}); pass family="
    )
