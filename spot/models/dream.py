"""Dream (HKUNLP/Dream, Dream-org/Dream-v0-Instruct-7B): Qwen2.5 layout, bidirectional, shifted.

What the original checkpoint and code say (sources: the hub files `configuration_dream.py`,
`modeling_dream.py`, `generation_utils.py` as copied in NVlabs/Fast-dLLM `dream/model/`, and
`generation_utils_block.py` there; HKUNLP/Dream `README.md`; the published config.json):

- config.json: `model_type: "Dream"`, `architectures: ["DreamModel"]`, Qwen2 keys
  (`hidden_size` 3584, `intermediate_size` 18944, `num_hidden_layers` 28,
  `num_attention_heads` 28, `num_key_value_heads` 4, `rms_norm_eps` 1e-6, `rope_theta` 1e6,
  `rope_scaling` null, `max_position_embeddings` 131072, `use_sliding_window` false,
  `tie_word_embeddings` false, `vocab_size` 152064) plus `mask_token_id` 151666 and
  `pad_token_id` = `bos_token_id` = `eos_token_id` = 151643 (`<|endoftext|>`); there is no
  `head_dim` key (head_dim = hidden_size / num_attention_heads = 128).
- parameters (Qwen2 names, `DreamModel.model` is the decoder): `model.embed_tokens.weight`,
  `model.layers.{i}.self_attn.{q,k,v}_proj.{weight,bias}` (q/k/v carry a bias),
  `model.layers.{i}.self_attn.o_proj.weight` (no bias), `model.layers.{i}.mlp.{gate,up,down}
  _proj.weight`, `model.layers.{i}.{input,post_attention}_layernorm.weight`,
  `model.norm.weight`, `lm_head.weight` (untied). These are the native names unchanged.
- attention: `is_causal = False` and the attention mask "full" when nothing is padded: every
  position attends every position of the whole canvas (prompt + all generated positions,
  masked ones included); positions 0..L-1; default rope over the whole head.
- logit shift: `logits = cat([logits[:, :1], logits[:, :-1]], dim=1)` — the logits used for
  position i are the model's output at position i-1, position 0 keeps its own. The first
  generated position is therefore predicted by the last prompt token.
- sampling (`alg="maskgit_plus"`, the top-probability rule): temperature, then top-p, then
  top-k, softmax; the confidence is the sampled token's probability under that distribution
  ("tempered"); at T=0 the argmax and its softmax probability.

Deviations of the native target from Dream's `diffusion_generate`, by design (docs/design.md §1.4):
blocks of the decode loop align to the end of the prompt with the project's per-block step
schedule (an even split); Dream's timestep schedule `int(n * (1 - s/t))` and its `entropy` /
`topk_margin` confidences are not reproduced; T>0 draws use the coupled Gumbel noise; and
decoding stops after a block that holds an EOS (`<|endoftext|>` or `<|im_end|>`), whose tail
Dream's own loop would go on filling, in practice with `<|endoftext|>`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from spot.models.registry import Family, register
from spot.models.transformer import TransformerConfig

MASK_ID = 151666
EOS_ID = 151643  # <|endoftext|>, also pad and bos


class Dream(Family):
    name = "dream"
    title = "Dream"
    architectures = ("DreamModel",)
    confidence = "tempered"
    block_causal = False
    absolute_block_grid = False
    logit_shift = True
    default_mask_id = MASK_ID
    default_max_length = 32768
    # Fast-dLLM's block sampler for Dream opens each block by committing its first position
    # (dream/model/generation_utils_block.py), then runs the commit rule
    opening_commit = True

    def native_config(self, raw: Mapping[str, Any]) -> TransformerConfig:
        self.check_qwen_options(raw)
        hidden, heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
        if hidden % heads:
            raise ValueError("Dream needs hidden_size divisible by num_attention_heads")
        return TransformerConfig(
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=hidden // heads,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(raw.get("rope_theta", 10000.0)),
            qkv_bias=True,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            max_position_embeddings=int(raw.get("max_position_embeddings", 32768)),
        )

    def original_config(
        self, config: TransformerConfig, mask_id: int, eos_ids: tuple[int, ...]
    ) -> dict[str, Any]:
        if config.head_dim * config.num_heads != config.hidden_size:
            raise ValueError("Dream needs head_dim * num_heads == hidden_size")
        if not config.qkv_bias or config.o_bias or config.qk_norm or config.rotary_dim:
            raise ValueError("not a Dream architecture (Qwen2 layout)")
        return {
            "architectures": list(self.architectures),
            "attention_dropout": 0.0,
            "auto_map": {
                "AutoConfig": "configuration_dream.DreamConfig",
                "AutoModel": "modeling_dream.DreamModel",
            },
            "bos_token_id": eos_ids[0],
            "eos_token_id": eos_ids[0],
            "hidden_act": "silu",
            "hidden_size": config.hidden_size,
            "initializer_range": 0.02,
            "intermediate_size": config.intermediate_size,
            "mask_token_id": mask_id,
            "max_position_embeddings": config.max_position_embeddings,
            "max_window_layers": config.num_layers,
            "model_type": self.model_types[0],
            "num_attention_heads": config.num_heads,
            "num_hidden_layers": config.num_layers,
            "num_key_value_heads": config.num_kv_heads,
            "pad_token_id": eos_ids[0],
            "rms_norm_eps": config.rms_norm_eps,
            "rope_scaling": None,
            "rope_theta": config.rope_theta,
            "sliding_window": None,
            "tie_word_embeddings": config.tie_word_embeddings,
            "use_cache": False,
            "use_sliding_window": False,
            "vocab_size": config.vocab_size,
        }

    def extra_eos_tokens(self) -> tuple[str, ...]:
        return ("<|im_end|>",)


DREAM_FAMILY = register(Dream())
