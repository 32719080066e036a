"""One decoder-only transformer for every target family, in plain torch.

The attention pattern is not built in: every forward takes an explicit boolean mask (True =
attend), so the same weights run bidirectionally (LLaDA, Dream), block-causally over an exact
KV cache (SDAR, LLaDA2.0) or with a tree mask over many candidates packed into one row.
Submodules carry the Qwen2/Qwen3 parameter names (`model.layers.{i}.self_attn.q_proj`, ...);
families with other names map them on load and save. The MLP is pluggable per layer so a
mixture-of-experts block can replace it.

Numerics follow the references: norms and rotary tables in float32 for low-precision weights
(float64 stays float64, for exactness tests).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

KVCache = list[tuple[torch.Tensor, torch.Tensor]]  # per layer (k, v) [N, Hkv, L, D]


@dataclass(frozen=True)
class TransformerConfig:
    """Architecture of the native decoder (family-independent names).

    rotary_dim: leading dims of each head that get rotary embeddings (None = all of them).
    rope_full_precision: apply the rotation in float32 and cast back (LLaDA); otherwise the
      float32 tables are cast to the activation dtype first (Qwen/SDAR/Dream).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rotary_dim: int | None = None
    rope_full_precision: bool = False
    qk_norm: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        rotary = self.rotary_dim if self.rotary_dim is not None else self.head_dim
        if rotary % 2 or not 0 < rotary <= self.head_dim:
            raise ValueError(f"rotary_dim {rotary} must be even and at most head_dim")


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for half-precision activations, the activation dtype otherwise."""
    return torch.promote_types(dtype, torch.float32)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(_compute_dtype(dtype))
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class RotaryEmbedding(nn.Module):
    """Default (unscaled) rotary embedding, rotate-half convention, explicit positions."""

    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.dim = config.rotary_dim if config.rotary_dim is not None else config.head_dim
        self.theta = config.rope_theta
        self.full_precision = config.rope_full_precision

    def tables(self, position_ids: torch.Tensor, dtype: torch.dtype):
        """cos, sin [N, 1, L, dim] for position_ids [N, L], in the rotation's dtype."""
        work = _compute_dtype(dtype)
        exponent = torch.arange(0, self.dim, 2, device=position_ids.device).to(work) / self.dim
        inv_freq = 1.0 / (self.theta**exponent)  # [dim/2]
        angles = position_ids.to(work)[..., None] * inv_freq  # [N, L, dim/2]
        angles = torch.cat([angles, angles], dim=-1)[:, None]  # [N, 1, L, dim]
        out = work if self.full_precision else dtype
        return angles.cos().to(out), angles.sin().to(out)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [N, H, L, D] with the first `dim` channels rotated."""
        rot, rest = x[..., : self.dim], x[..., self.dim :]
        rot = rot.to(cos.dtype)
        half = self.dim // 2
        rotated = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
        out = (rot * cos + rotated * sin).to(x.dtype)
        return torch.cat([out, rest], dim=-1) if rest.numel() else out


class Attention(nn.Module):
    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        h, d = config.hidden_size, config.head_dim
        self.q_proj = nn.Linear(h, config.num_heads * d, bias=config.qkv_bias)
        self.k_proj = nn.Linear(h, config.num_kv_heads * d, bias=config.qkv_bias)
        self.v_proj = nn.Linear(h, config.num_kv_heads * d, bias=config.qkv_bias)
        self.o_proj = nn.Linear(config.num_heads * d, h, bias=config.o_bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(d, config.rms_norm_eps)
            self.k_norm = RMSNorm(d, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(
        self,
        x: torch.Tensor,
        rope: RotaryEmbedding,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None,
        past: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """x [N, L, H], mask bool [N, 1, L, Lpast + L] or None -> out [N, L, H], new (k, v)."""
        n, length, _ = x.shape
        q = self.q_proj(x).view(n, length, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(n, length, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(n, length, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = rope(q.transpose(1, 2), cos, sin)  # [N, Hq, L, D]
        k = rope(k.transpose(1, 2), cos, sin)  # [N, Hkv, L, D]
        v = v.transpose(1, 2)  # [N, Hkv, L, D]
        new_kv = (k, v)
        if past is not None:
            k = torch.cat([past[0], k], dim=2)
            v = torch.cat([past[1], v], dim=2)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, enable_gqa=self.num_heads != self.num_kv_heads
        )  # [N, Hq, L, D]
        out = out.transpose(1, 2).reshape(n, length, self.num_heads * self.head_dim)
        return self.o_proj(out), new_kv


class SwiGLU(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class TokenEmbedding(nn.Embedding):
    """nn.Embedding that skips its random init on the meta device (nothing to initialise
    there, and meta normal_ imports torch's compiler stack, seconds per process)."""

    def reset_parameters(self) -> None:
        if not self.weight.is_meta:
            super().reset_parameters()


MLPFactory = Callable[[int], nn.Module]  # layer index -> MLP module (x [.., H] -> [.., H])


class DecoderLayer(nn.Module):
    def __init__(self, config: TransformerConfig, mlp: nn.Module):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = mlp

    def forward(self, x, rope, cos, sin, mask, past):
        attn, new_kv = self.self_attn(self.input_layernorm(x), rope, cos, sin, mask, past)
        x = x + attn
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, new_kv


class Backbone(nn.Module):
    def __init__(self, config: TransformerConfig, mlp_factory: MLPFactory):
        super().__init__()
        self.embed_tokens = TokenEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, mlp_factory(i)) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config)


class Transformer(nn.Module):
    """Decoder with an explicit attention mask and an optional past KV per layer."""

    def __init__(self, config: TransformerConfig, mlp_factory: MLPFactory | None = None):
        super().__init__()
        self.config = config
        if mlp_factory is None:

            def mlp_factory(_: int) -> nn.Module:
                return SwiGLU(config.hidden_size, config.intermediate_size)

        self.model = Backbone(config, mlp_factory)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        past_kv: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None,
        output_hidden: bool = False,
        logits_at: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, KVCache]:
        """Run the stack.

        input_ids, position_ids: [N, L] long; attention_mask: bool broadcastable to
        [N, 1, L, Lpast + L] (True = attend; each query row must attend at least one key;
        None = every query attends every key); past_kv: per layer
        (k, v) [N, Hkv, Lpast, D] or None; logits_at: [N, S] indices into L to compute
        logits (and hidden) for, None = every position.
        Returns logits [N, S, V], final-norm hidden [N, S, H] when asked, and the new
        tokens' (k, v) [N, Hkv, L, D] per layer.
        """
        backbone = self.model
        x = backbone.embed_tokens(input_ids)  # [N, L, H]
        cos, sin = backbone.rotary.tables(position_ids, x.dtype)
        new_kv: KVCache = []
        for i, layer in enumerate(backbone.layers):
            past = None if past_kv is None else past_kv[i]
            x, kv = layer(x, backbone.rotary, cos, sin, attention_mask, past)
            new_kv.append(kv)
        if logits_at is not None:
            x = x.gather(1, logits_at[..., None].expand(-1, -1, x.shape[-1]))  # [N, S, H]
        hidden = backbone.norm(x)
        logits = self.lm_head(hidden)
        return logits, hidden if output_hidden else None, new_kv

    def full_logits(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Logits [1, L, V] of one sequence [1, L] from scratch; mask bool [1, 1, L, L] or
        None for full bidirectional attention. The reference for cache and packing tests."""
        position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)[None]
        return self(input_ids, position_ids, attention_mask)[0]

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Input embeddings [..., H] of tokens [...]."""
        return self.model.embed_tokens(tokens)


def block_causal_mask(length: int, block_length: int, device=None) -> torch.Tensor:
    """bool [1, 1, L, L]: position i attends j iff block(j) <= block(i), blocks of
    `block_length` aligned to position 0 (SDAR / LLaDA2.0 attention)."""
    block = torch.arange(length, device=device) // block_length
    return (block[None, :] <= block[:, None])[None, None]
