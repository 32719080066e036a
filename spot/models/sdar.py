"""SDAR (JetAstra/SDAR): Qwen3 layout, block-causal attention over an absolute block grid.

Parameter names are Qwen3's (`model.layers.{i}.self_attn.q_norm.weight`, ...), which the
native transformer uses as they are. Confidence at T>0 is the probability of the sampled token
under the tempered, filtered distribution; EOS ids come from generation_config.json
(`<|im_end|>`, `<|endoftext|>` for the chat models).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from spot.models.registry import Family, register
from spot.models.transformer import TransformerConfig


class SDAR(Family):
    name = "sdar"
    title = "SDAR"
    architectures = ("SDARForCausalLM",)
    confidence = "tempered"
    block_causal = True
    absolute_block_grid = True
    fresh_traits = {"rms_norm_eps": 1e-6, "qk_norm": True}  # Qwen3's

    def native_config(self, raw: Mapping[str, Any]) -> TransformerConfig:
        self.check_qwen_options(raw)
        heads = int(raw["num_attention_heads"])
        return TransformerConfig(
            vocab_size=int(raw["vocab_size"]),
            hidden_size=int(raw["hidden_size"]),
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or raw["hidden_size"] // heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(raw.get("rope_theta", 10000.0)),
            qk_norm=True,
            qkv_bias=bool(raw.get("attention_bias", False)),
            o_bias=bool(raw.get("attention_bias", False)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            max_position_embeddings=int(raw.get("max_position_embeddings", 32768)),
        )

    def original_config(
        self, config: TransformerConfig, mask_id: int, eos_ids: tuple[int, ...]
    ) -> dict[str, Any]:
        if config.qkv_bias != config.o_bias or not config.qk_norm or config.rotary_dim:
            raise ValueError("not an SDAR architecture (Qwen3 layout)")
        return {
            "architectures": list(self.architectures),
            "attention_bias": config.qkv_bias,
            "attention_dropout": 0.0,
            "bos_token_id": eos_ids[-1],
            "eos_token_id": eos_ids[-1],
            "block_size": 4,
            "mask_token_id": mask_id,
            "head_dim": config.head_dim,
            "hidden_act": "silu",
            "hidden_size": config.hidden_size,
            "initializer_range": 0.02,
            "intermediate_size": config.intermediate_size,
            "max_position_embeddings": config.max_position_embeddings,
            "max_window_layers": config.num_layers,
            "model_type": self.name,
            "num_attention_heads": config.num_heads,
            "num_hidden_layers": config.num_layers,
            "num_key_value_heads": config.num_kv_heads,
            "rms_norm_eps": config.rms_norm_eps,
            "rope_scaling": None,
            "rope_theta": config.rope_theta,
            "sliding_window": None,
            "tie_word_embeddings": config.tie_word_embeddings,
            "use_cache": False,
            "use_sliding_window": False,
            "vocab_size": config.vocab_size,
        }

    def chat_eos_ids(self, end_of_text: int, end_of_turn: int) -> tuple[int, ...]:
        """<|im_end|> first, as the Qwen chat models list it."""
        return (end_of_turn, end_of_text)


SDAR_FAMILY = register(SDAR())
