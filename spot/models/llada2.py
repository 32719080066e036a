"""LLaDA2.0 (inclusionAI/LLaDA2.0-mini): Ling 2.0 MoE layout, block diffusion, absolute grid.

What the original checkpoint and code say (sources: the hub `modeling_llada2_moe.py` and
`configuration_llada2_moe.py`, as copied in AnZhong24/FOCUS
`opencompass-0.5.1.post1/opencompass/models/LLaDA2.0-mini/` and in the dllm pipelines; the
mini config as published in inclusionAI/dFactory `configs/model_configs/llada2_mini/`;
inclusionAI/dInfer `python/dinfer/model/`, benchmarks and `decoding/`; dFactory
`scripts/moe_convertor.py` for the per-expert names):

- config.json (`model_type: "llada2_moe"`, `architectures: ["LLaDA2MoeModelLM"]`):
  `hidden_size` 2048, `num_hidden_layers` 20, `num_attention_heads` 16,
  `num_key_value_heads` 4, `head_dim` 128, `intermediate_size` 5120 (dense layers),
  `first_k_dense_replace` 1 (layer 0 dense, the rest MoE), `num_experts` 256,
  `num_experts_per_tok` 8, `num_shared_experts` 1, `moe_intermediate_size` 512, `n_group` 8,
  `topk_group` 4, `routed_scaling_factor` 2.5, `score_function` "sigmoid", `router_dtype`
  "fp32", `moe_router_enable_expert_bias` true, `norm_topk_prob` true, `use_qk_norm` true,
  `use_qkv_bias` false, `use_bias` false, `partial_rotary_factor` 0.5 (`rotary_dim` 64),
  `rope_theta` 600000, `rms_norm_eps` 1e-6, `max_position_embeddings` 32768,
  `vocab_size` 157184, `pad_token_id` 156892, `tie_word_embeddings` false. There is no mask
  or EOS key: `generate` defaults to `mask_id=156895`, `eos_id=156892`. Keys the hub code
  reads but the routing ignores (`norm_topk_prob`, `score_function`, `router_dtype`) are
  checked to have the values the code hard-wires.
- parameters: `model.word_embeddings.weight`; per layer `attention.query_key_value.weight`
  (fused, rows [q heads | k heads | v heads], bias when `use_qkv_bias`),
  `attention.query_layernorm.weight` / `attention.key_layernorm.weight` (RMSNorm over the
  head dim, before rope), `attention.dense.weight` (output projection, bias when `use_bias`),
  `input_layernorm.weight`, `post_attention_layernorm.weight`; dense layers
  `mlp.{gate,up,down}_proj.weight`; MoE layers `mlp.gate.weight`, `mlp.gate.expert_bias`,
  `mlp.experts.{e}.{gate,up,down}_proj.weight`, `mlp.shared_experts.{gate,up,down}_proj
  .weight`; `model.norm.weight`, `lm_head.weight`.
- attention: scale head_dim**-0.5, GQA; rope (default, rotate-half) on the first
  `head_dim * partial_rotary_factor` channels of each head only; logits in float32.
- MoE routing: see `spot.models.moe` (sigmoid scores, expert bias for selection only,
  group-limited top-k, normalised unbiased weights times 2.5, plus the shared expert).
- `generate`: total length ceil((P + gen_length) / B) * B, blocks aligned to position 0 (the
  prompt's partial block is decoded as the first block), attention block-causal
  (`tril(ones(blocks, blocks))` expanded to tokens), positions 0..L-1, the whole prefix
  recomputed every step (a KV cache of final blocks computes the same keys); per-step
  count from the whole block's schedule; commit `{confidence > threshold}` when at least k
  positions pass, else the top min(k, masked) — the `sdar_dynamic` rule, threshold 0.95 by
  default; confidence is the sampled token's probability under the tempered, top-k/top-p
  filtered distribution; stop after a block holding `eos_id`; no logit shift.

Deviations: at temperature 0 the hub `generate` still draws with `torch.multinomial` from the
untempered softmax (it only divides by T when T > 0); the native decoder takes the argmax
there, as docs/design.md §1.4 and the docstring of `generate` ("0.0 corresponds to greedy decoding")
say. In bfloat16 the hub model casts `expert_bias` to bfloat16 with the rest of the module
(`model.to(torch.bfloat16)`); so does `load_model(dtype=torch.bfloat16)`, and routing then
adds it to the float32 scores just as the hub code does.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from spot.models.moe import MoESpec, SparseMoE
from spot.models.registry import Decoding, Family, Renames, register
from spot.models.transformer import SwiGLU, Transformer, TransformerConfig

MASK_ID = 156895
EOS_ID = 156892  # <|endoftext|>, also pad


@dataclass(frozen=True)
class LLaDA2Config(TransformerConfig):
    """The native transformer plus the MoE layout. num_experts 0 = every layer dense."""

    num_experts: int = 0
    experts_per_token: int = 1
    expert_size: int = 0  # moe_intermediate_size
    num_shared_experts: int = 0
    num_groups: int = 1  # n_group
    groups_per_token: int = 1  # topk_group
    routed_scaling_factor: float = 1.0
    first_dense_layers: int = 0  # first_k_dense_replace

    def is_moe_layer(self, layer: int) -> bool:
        return self.num_experts > 0 and layer >= self.first_dense_layers

    def moe_spec(self) -> MoESpec:
        return MoESpec(
            hidden_size=self.hidden_size,
            num_experts=self.num_experts,
            experts_per_token=self.experts_per_token,
            expert_size=self.expert_size,
            shared_size=self.expert_size * self.num_shared_experts,
            num_groups=self.num_groups,
            groups_per_token=self.groups_per_token,
            scaling=self.routed_scaling_factor,
        )


# (original prefix, native prefix) of the one-to-one names; layer index as {i}; every
# other name but the fused, split and per-expert ones below is shared by both layouts
_RENAMES = Renames(
    "LLaDA2",
    (
        ("model.word_embeddings.weight", "model.embed_tokens.weight"),
        ("model.layers.{i}.attention.dense.", "model.layers.{i}.self_attn.o_proj."),
        ("model.layers.{i}.attention.query_layernorm.", "model.layers.{i}.self_attn.q_norm."),
        ("model.layers.{i}.attention.key_layernorm.", "model.layers.{i}.self_attn.k_norm."),
    ),
    keep_others=True,
)
_FUSED = re.compile(r"^model\.layers\.(\d+)\.attention\.query_key_value\.(weight|bias)$")
_SPLIT = re.compile(r"^model\.layers\.(\d+)\.self_attn\.([qkv])_proj\.(weight|bias)$")
_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(\w+_proj)\.weight$")
_STACKED = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\w+_proj)$")


class LLaDA2(Family):
    name = "llada2"
    title = "LLaDA2"
    architectures = ("LLaDA2MoeModelLM",)
    confidence = "tempered"
    block_causal = True
    absolute_block_grid = True
    default_mask_id = MASK_ID
    default_max_length = 16384

    def native_config(self, raw: Mapping[str, Any]) -> LLaDA2Config:
        fixed = {
            "hidden_act": "silu",
            "score_function": "sigmoid",
            "router_dtype": "fp32",
            "norm_topk_prob": True,
            "moe_router_enable_expert_bias": True,
            "norm_head": False,
            "using_split_qkv_in_self_attention": False,
            "use_sliding_window": False,
        }
        self.check_fixed(raw, fixed)
        self.check_default_rope(raw)
        hidden, heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
        head_dim = int(raw.get("head_dim") or hidden // heads)
        rotary = int(head_dim * float(raw.get("partial_rotary_factor", 0.5)))
        if raw.get("rotary_dim") is not None and int(raw["rotary_dim"]) != rotary:
            raise ValueError(f"LLaDA2 rotary_dim {raw['rotary_dim']} != head_dim * factor")
        experts = raw.get("num_experts")
        shared = raw.get("num_shared_experts")
        return LLaDA2Config(
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(raw["num_key_value_heads"]),
            head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
            rope_theta=float(raw.get("rope_theta", 10000.0)),
            rotary_dim=rotary,
            qk_norm=bool(raw.get("use_qk_norm", True)),
            qkv_bias=bool(raw.get("use_qkv_bias", False)),
            o_bias=bool(raw.get("use_bias", True)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            max_position_embeddings=int(raw.get("max_position_embeddings", 16384)),
            num_experts=int(experts or 0),
            experts_per_token=int(raw.get("num_experts_per_tok", 2)),
            expert_size=int(raw.get("moe_intermediate_size") or 0),
            num_shared_experts=int(shared or 0),
            num_groups=int(raw.get("n_group", 8)),
            groups_per_token=int(raw.get("topk_group", 4)),
            routed_scaling_factor=float(raw.get("routed_scaling_factor", 2.5)),
            first_dense_layers=int(raw.get("first_k_dense_replace", 0)),
        )

    def original_config(
        self, config: TransformerConfig, mask_id: int, eos_ids: tuple[int, ...]
    ) -> dict[str, Any]:
        if not isinstance(config, LLaDA2Config):
            raise ValueError("an LLaDA2 checkpoint needs an LLaDA2Config")
        rotary = config.rotary_dim if config.rotary_dim is not None else config.head_dim
        return {
            "architectures": list(self.architectures),
            "attention_dropout": 0.0,
            "auto_map": {
                "AutoConfig": "configuration_llada2_moe.LLaDA2MoeConfig",
                "AutoModel": "modeling_llada2_moe.LLaDA2MoeModel",
                "AutoModelForCausalLM": "modeling_llada2_moe.LLaDA2MoeModelLM",
            },
            "embedding_dropout": 0.0,
            "eos_token_id": eos_ids[0],
            "first_k_dense_replace": config.first_dense_layers,
            "head_dim": config.head_dim,
            "hidden_act": "silu",
            "hidden_size": config.hidden_size,
            "initializer_range": 0.02,
            "intermediate_size": config.intermediate_size,
            "mask_token_id": mask_id,
            "max_position_embeddings": config.max_position_embeddings,
            "max_window_layers": config.num_layers,
            "model_type": self.model_types[0],
            "moe_intermediate_size": config.expert_size,
            "moe_router_enable_expert_bias": True,
            "n_group": config.num_groups,
            "norm_head": False,
            "norm_softmax": False,
            "norm_topk_prob": True,
            "num_attention_heads": config.num_heads,
            "num_experts": config.num_experts or None,
            "num_experts_per_tok": config.experts_per_token,
            "num_hidden_layers": config.num_layers,
            "num_key_value_heads": config.num_kv_heads,
            "num_shared_experts": config.num_shared_experts or None,
            "output_dropout": 0.0,
            "output_router_logits": False,
            "pad_token_id": eos_ids[0],
            "partial_rotary_factor": rotary / config.head_dim,
            "rms_norm_eps": config.rms_norm_eps,
            "rope_scaling": None,
            "rope_theta": config.rope_theta,
            "rotary_dim": rotary,
            "routed_scaling_factor": config.routed_scaling_factor,
            "router_dtype": "fp32",
            "score_function": "sigmoid",
            "tie_word_embeddings": config.tie_word_embeddings,
            "topk_group": config.groups_per_token,
            "use_bias": config.o_bias,
            "use_cache": False,
            "use_qk_norm": config.qk_norm,
            "use_qkv_bias": config.qkv_bias,
            "use_rmsnorm": True,
            "use_sliding_window": False,
            "using_split_qkv_in_self_attention": False,
            "vocab_size": config.vocab_size,
        }

    def decoding(
        self, raw: Mapping[str, Any], generation: Mapping[str, Any], extra_eos: tuple[int, ...]
    ) -> Decoding:
        """The published config names no EOS; `generate` stops at 156892."""
        if generation.get("eos_token_id") is None and raw.get("eos_token_id") is None:
            generation = {**generation, "eos_token_id": EOS_ID}
        return super().decoding(raw, generation, extra_eos)

    # -- model and parameter names -----------------------------------------------------------
    def build(self, config: TransformerConfig) -> Transformer:
        if not isinstance(config, LLaDA2Config):
            raise ValueError("an LLaDA2 model needs an LLaDA2Config")

        def mlp(layer: int) -> nn.Module:
            if config.is_moe_layer(layer):
                return SparseMoE(config.moe_spec())
            return SwiGLU(config.hidden_size, config.intermediate_size)

        return Transformer(config, mlp)

    def to_native(self, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        native: dict[str, torch.Tensor] = {}
        experts: dict[str, dict[int, torch.Tensor]] = {}
        for name, tensor in state.items():
            fused, expert = _FUSED.match(name), _EXPERT.match(name)
            if expert is not None:
                layer, index, proj = expert.groups()
                experts.setdefault(f"model.layers.{layer}.mlp.experts.{proj}", {})[int(index)] = (
                    tensor
                )
            elif fused is not None:
                layer, kind = fused.groups()
                for part, piece in zip("qkv", self._split_qkv(tensor, layer, state)):
                    # a copy of its own: a view into the fused rows would compute differently
                    native[f"model.layers.{layer}.self_attn.{part}_proj.{kind}"] = piece.clone()
            else:
                native[_RENAMES.to_native(name)] = tensor
        for name, by_index in experts.items():
            if sorted(by_index) != list(range(len(by_index))):
                raise ValueError(f"{name}: experts {sorted(by_index)} are not 0..n-1")
            native[name] = torch.stack([by_index[i] for i in range(len(by_index))])
        return native

    def to_original(self, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        original = {}
        for name, tensor in state.items():
            split, stacked = _SPLIT.match(name), _STACKED.match(name)
            if stacked is not None:
                layer, proj = stacked.groups()
                for index, weight in enumerate(tensor.unbind()):
                    original[f"model.layers.{layer}.mlp.experts.{index}.{proj}.weight"] = weight
            elif split is not None:
                layer, part, kind = split.groups()
                if part == "q":
                    prefix = f"model.layers.{layer}.self_attn"
                    parts = [state[f"{prefix}.{p}_proj.{kind}"] for p in "qkv"]
                    fused = torch.cat(parts)
                    original[f"model.layers.{layer}.attention.query_key_value.{kind}"] = fused
            else:
                original[_RENAMES.to_original(name)] = tensor
        return original

    @staticmethod
    def _split_qkv(fused: torch.Tensor, layer: str, state: Mapping[str, torch.Tensor]):
        """Rows [q | k | v] of a fused projection; the q width follows from the output
        projection (`dense` [H, heads * head_dim]), k and v share the rest equally."""
        q_width = state[f"model.layers.{layer}.attention.dense.weight"].shape[1]
        kv_width = (fused.shape[0] - q_width) // 2
        return fused.split([q_width, kv_width, kv_width])


LLADA2_FAMILY = register(LLaDA2())
