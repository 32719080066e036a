"""LLaDA (ML-GSAI/LLaDA): OLMo-style Llama block, bidirectional attention, no cache.

Original names (modeling_llada.py, `block_type: llama`): `model.transformer.wte` (embedding),
per block `q_proj`/`k_proj`/`v_proj`, `attn_out` (output projection), `attn_norm` and
`ff_norm` (RMSNorm before attention / MLP), `ff_proj` (the SiLU-gated projection), `up_proj`
and `ff_out` (down projection); `model.transformer.ln_f` and `model.transformer.ff_out` (LM
head, absent when `weight_tying`). Rotary embeddings are applied in float32
(`rope_full_precision`). Blocks align to the end of the prompt, the mask token is 126336,
confidence at T>0 is the untempered softmax probability of the sampled token, and
`<|eot_id|>` ends a chat turn as well as `<|endoftext|>`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from spot.models.registry import Family, Renames, register
from spot.models.transformer import TransformerConfig

MASK_ID = 126336

# (original prefix, native prefix); layer index as {i}
_RENAMES = Renames(
    "LLaDA",
    (
        ("model.transformer.wte.weight", "model.embed_tokens.weight"),
        ("model.transformer.ln_f.weight", "model.norm.weight"),
        ("model.transformer.ff_out.weight", "lm_head.weight"),
        ("model.transformer.blocks.{i}.q_proj.", "model.layers.{i}.self_attn.q_proj."),
        ("model.transformer.blocks.{i}.k_proj.", "model.layers.{i}.self_attn.k_proj."),
        ("model.transformer.blocks.{i}.v_proj.", "model.layers.{i}.self_attn.v_proj."),
        ("model.transformer.blocks.{i}.attn_out.", "model.layers.{i}.self_attn.o_proj."),
        ("model.transformer.blocks.{i}.ff_proj.", "model.layers.{i}.mlp.gate_proj."),
        ("model.transformer.blocks.{i}.up_proj.", "model.layers.{i}.mlp.up_proj."),
        ("model.transformer.blocks.{i}.ff_out.", "model.layers.{i}.mlp.down_proj."),
        ("model.transformer.blocks.{i}.attn_norm.", "model.layers.{i}.input_layernorm."),
        ("model.transformer.blocks.{i}.ff_norm.", "model.layers.{i}.post_attention_layernorm."),
    ),
    keep_others=False,
)


class LLaDA(Family):
    name = "llada"
    title = "LLaDA"
    architectures = ("LLaDAModelLM",)
    confidence = "untempered"
    block_causal = False
    absolute_block_grid = False
    fresh_traits = {"rms_norm_eps": 1e-5, "rope_full_precision": True}
    default_mask_id = MASK_ID
    max_length_key = "max_sequence_length"
    default_max_length = 4096

    def native_config(self, raw: Mapping[str, Any]) -> TransformerConfig:
        expected = {
            "block_type": "llama",
            "activation_type": "silu",
            "layer_norm_type": "rms",
            "rope": True,
            "alibi": False,
            "attention_layer_norm": False,
            "include_bias": False,
            "input_emb_norm": False,
            "scale_logits": False,
        }
        self.check_fixed(raw, expected)
        d_model, heads = int(raw["d_model"]), int(raw["n_heads"])
        multi_query = bool(raw.get("multi_query_attention"))
        kv_heads = 1 if multi_query else int(raw.get("n_kv_heads") or heads)
        mlp = raw.get("mlp_hidden_size") or int(raw.get("mlp_ratio", 4)) * d_model
        qkv_bias = bool(raw.get("include_qkv_bias", False))
        return TransformerConfig(
            vocab_size=int(raw.get("embedding_size") or raw["vocab_size"]),
            hidden_size=d_model,
            intermediate_size=int(mlp),
            num_layers=int(raw["n_layers"]),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=d_model // heads,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
            rope_theta=float(raw.get("rope_theta", 10000.0)),
            rope_full_precision=bool(raw.get("rope_full_precision", True)),
            qkv_bias=qkv_bias,
            tie_word_embeddings=bool(raw.get("weight_tying", False)),
            max_position_embeddings=int(raw.get("max_sequence_length", 4096)),
        )

    def original_config(
        self, config: TransformerConfig, mask_id: int, eos_ids: tuple[int, ...]
    ) -> dict[str, Any]:
        if config.head_dim * config.num_heads != config.hidden_size:
            raise ValueError("LLaDA needs head_dim * num_heads == hidden_size")
        if config.qk_norm or config.o_bias or config.rotary_dim:
            raise ValueError("not a LLaDA architecture")
        return {
            "activation_type": "silu",
            "alibi": False,
            "alibi_bias_max": 8.0,
            "architectures": list(self.architectures),
            "attention_dropout": 0.0,
            "attention_layer_norm": False,
            "attention_layer_norm_with_affine": True,
            "bias_for_layer_norm": False,
            "block_group_size": 1,
            "block_type": "llama",
            "d_model": config.hidden_size,
            "embedding_dropout": 0.0,
            "embedding_size": config.vocab_size,
            "eos_token_id": eos_ids[0],
            "flash_attention": False,
            "include_bias": False,
            "include_qkv_bias": config.qkv_bias,
            "init_cutoff_factor": None,
            "init_device": "meta",
            "init_fn": "mitchell",
            "init_std": 0.02,
            "input_emb_norm": False,
            "layer_norm_type": "rms",
            "layer_norm_with_affine": True,
            "mask_token_id": mask_id,
            "max_sequence_length": config.max_position_embeddings,
            "mlp_hidden_size": config.intermediate_size,
            "mlp_ratio": 4,
            "model_type": self.name,
            "multi_query_attention": None,
            "n_heads": config.num_heads,
            "n_kv_heads": config.num_kv_heads,
            "n_layers": config.num_layers,
            "pad_token_id": eos_ids[0],
            "precision": "amp_bf16",
            "residual_dropout": 0.0,
            "rms_norm_eps": config.rms_norm_eps,
            "rope": True,
            "rope_full_precision": config.rope_full_precision,
            "rope_theta": config.rope_theta,
            "scale_logits": False,
            "use_cache": False,
            "vocab_size": config.vocab_size,
            "weight_tying": config.tie_word_embeddings,
        }

    def to_native(self, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {_RENAMES.to_native(name): tensor for name, tensor in state.items()}

    def to_original(self, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {_RENAMES.to_original(name): tensor for name, tensor in state.items()}

    def extra_eos_tokens(self) -> tuple[str, ...]:
        return ("<|eot_id|>",)


LLADA_FAMILY = register(LLaDA())
