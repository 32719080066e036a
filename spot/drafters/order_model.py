"""SPOT's order model: which masked position does the target commit next?

A small transformer encoder over the block's positions that reads only model-agnostic
features of the *stale* distribution (the target's last exact forward) and of a hypothesis
state a few steps ahead, so one checkpoint can serve targets of any width or vocabulary.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from spot.commit import confidence_rank, sample_tokens

# log(1 - confidence) >= log(1e-16) ~ -36.8 (float64 probabilities saturate there, and so do
# the target's own): the feature stays within [-1, 0]
DOUBT_SCALE = 36.85


@dataclass(frozen=True)
class OrderModelConfig:
    top_k: int = 32  # stale probabilities per position
    d_model: int = 128
    num_layers: int = 3
    num_heads: int = 8
    ff_size: int = 512
    max_block_length: int = 64
    max_lookahead: int = 8

    @property
    def num_features(self) -> int:
        # top-k probs, masked, assumed-committed, coupled-noise confidence, its rank among the
        # masked positions, its log(1 - confidence), step fraction, depth
        return self.top_k + 7

    @property
    def confidence_index(self) -> int:
        """Feature index of the coupled-noise confidence."""
        return self.top_k + 2

    @property
    def rank_index(self) -> int:
        """Feature index of the confidence rank / block length (0: the most confident)."""
        return self.top_k + 3

    @property
    def log_doubt_index(self) -> int:
        """Feature index of log(1 - confidence) / DOUBT_SCALE."""
        return self.top_k + 4

    def to_dict(self) -> dict:
        return asdict(self)


def stale_top(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k untempered log-probabilities [..., k] (float32, descending) and their ids [..., k];
    padded with -inf when the vocabulary is smaller than k.

    Log-probabilities, not probabilities: the commit order among confident positions rests on
    differences like 1 - 3e-9 vs 1 - 8e-10, which float32 probabilities round to one value
    (ties at the top in most recorded steps, docs/benchmarks.md §5.1) while float32
    log-probabilities keep them."""
    logp = torch.log_softmax(logits.double(), dim=-1)
    top = torch.topk(logp, min(k, logp.shape[-1]), dim=-1)
    pad = k - top.values.shape[-1]
    return (
        torch.nn.functional.pad(top.values.float(), (0, pad), value=float("-inf")),
        torch.nn.functional.pad(top.indices, (0, pad)),
    )


def noisy_confidence(
    top_logprobs: torch.Tensor,
    top_ids: torch.Tensor,
    gumbel: torch.Tensor | None,
    temperature: float,
    confidence: str,
) -> torch.Tensor:
    """The stale confidence of the token the coupled noise picks, per position.

    top_logprobs/top_ids: [..., K] the stale distribution's top-k; gumbel: [..., V] noise of
    the hypothesis step (None at T=0). Restricted to the top-k (tokens outside it win rarely),
    this is what the target's own confidence will be if its distribution has not moved.
    Returns [...] float64, the precision the commit rules order positions in.
    """
    logp = top_logprobs.double()
    if gumbel is None or temperature == 0.0:
        return logp[..., 0].exp()
    noise = gumbel.gather(-1, top_ids.long().to(gumbel.device)).to(top_ids.device)
    _, conf = sample_tokens(logp, noise, temperature, confidence=confidence)
    return conf


def order_features(
    top_logprobs: torch.Tensor,
    masked: torch.Tensor,
    assumed: torch.Tensor,
    noisy_conf: torch.Tensor,
    step_fraction: torch.Tensor,
    depth: torch.Tensor,
    config: OrderModelConfig,
) -> torch.Tensor:
    """Per-position inputs [N, B, F].

    top_logprobs [N, B, K] stale top-k log-probabilities; masked [N, B] still masked in the
    hypothesis; assumed [N, B] committed by the hypothesis since the stale forward; noisy_conf
    [N, B] float64;
    step_fraction [N] transitions taken in the block / steps per block; depth [N] hypothesis
    steps ahead of the stale forward. The confidence rank (the commit rules' own ordering,
    lower index first on ties) and log(1 - confidence) resolve what a linear read of
    probabilities near 1 cannot: which of several confident positions the target takes first.
    """
    n, b, _ = top_logprobs.shape
    conf = noisy_conf.double()
    rank = confidence_rank(conf, masked)
    doubt = torch.log1p(-conf).clamp_min(-DOUBT_SCALE) / DOUBT_SCALE
    return torch.cat(
        [
            top_logprobs.float().exp(),
            masked.float().unsqueeze(-1),
            assumed.float().unsqueeze(-1),
            conf.float().unsqueeze(-1),
            (rank.float() / b).unsqueeze(-1),
            doubt.float().unsqueeze(-1),
            step_fraction.float().view(n, 1, 1).expand(n, b, 1),
            (depth.float() / config.max_lookahead).view(n, 1, 1).expand(n, b, 1),
        ],
        dim=-1,
    )


def affine(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, cache: dict) -> torch.Tensor:
    """x [..., in] @ weight [out, in].T + bias, as F.linear.

    Without autograd (drafting, evaluation) it multiplies by a contiguous [in, out] copy of the
    weight kept in `cache` until the weight changes (optimizer step, load_state_dict): MKL runs
    these drafters' GEMMs of 32 rows faster on it than on the transposed view F.linear hands
    it (docs/benchmarks.md §6.1).
    """
    if torch.is_grad_enabled():
        return F.linear(x, weight, bias)
    key = (weight.device, weight.data_ptr(), weight._version)
    if cache.get("key") != key:
        cache["key"], cache["weight"] = key, weight.detach().t().contiguous()
    flat = torch.addmm(bias, x.reshape(-1, x.shape[-1]), cache["weight"])
    return flat.view(*x.shape[:-1], weight.shape[0])


class Linear(nn.Linear):
    """nn.Linear (same parameters and keys) whose inference runs on `affine`'s cached copy."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__(in_features, out_features)
        self.input_major: dict = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return affine(x, self.weight, self.bias, self.input_major)


class SelfAttention(nn.Module):
    """Multi-head self-attention over a block's positions, no mask."""

    def __init__(self, d_model: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.in_proj_weight = nn.Parameter(torch.empty(3 * d_model, d_model))
        self.in_proj_bias = nn.Parameter(torch.zeros(3 * d_model))
        self.in_proj_input_major: dict = {}
        self.out_proj = Linear(d_model, d_model)
        nn.init.xavier_uniform_(self.in_proj_weight)
        nn.init.zeros_(self.out_proj.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, b, d = x.shape  # [N, B, D]
        qkv = affine(x, self.in_proj_weight, self.in_proj_bias, self.in_proj_input_major)
        q, k, v = qkv.view(n, b, 3, self.num_heads, d // self.num_heads).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v)  # [N, heads, B, D / heads]
        return self.out_proj(out.transpose(1, 2).reshape(n, b, d))


class EncoderLayer(nn.Module):
    """Pre-norm encoder layer, ReLU feed-forward. Parameter names are those of torch's
    `nn.TransformerEncoderLayer`, so checkpoints keep their keys; the forward is plain
    functional code, since torch's module spends a good part of this small model's call on
    per-call checks (docs/benchmarks.md §6.1)."""

    def __init__(self, d_model: int, num_heads: int, ff_size: int):
        super().__init__()
        self.self_attn = SelfAttention(d_model, num_heads)
        self.linear1 = Linear(d_model, ff_size)
        self.linear2 = Linear(ff_size, d_model)
        self.norm1 = nn.LayerNorm(d_model)
        self.norm2 = nn.LayerNorm(d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.norm1(x))
        return x + self.linear2(F.relu(self.linear1(self.norm2(x))))


class Encoder(nn.Module):
    """[N, B, D] -> [N, B, D]: the drafters' transformer encoder over block positions."""

    def __init__(self, config: OrderModelConfig):
        super().__init__()
        self.layers = nn.ModuleList(
            EncoderLayer(config.d_model, config.num_heads, config.ff_size)
            for _ in range(config.num_layers)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class OrderModel(nn.Module):
    """Features [N, B, F] + masked [N, B] -> logits over the next committed position [N, B]
    (-inf where not masked).

    The logits are a learned correction on top of the commit rule's own guess: a scaled
    -log(1 - confidence) (most confident first, as the target would commit if its distribution
    did not move). Training starts from that ordering (the correction head starts at zero)
    instead of discovering it."""

    def __init__(self, config: OrderModelConfig):
        super().__init__()
        self.config = config
        self.input = Linear(config.num_features, config.d_model)
        self.position = nn.Embedding(config.max_block_length, config.d_model)
        self.encoder = Encoder(config)
        self.norm = nn.LayerNorm(config.d_model)
        self.head = Linear(config.d_model, 1)
        nn.init.zeros_(self.head.weight)  # untrained, the model is the rule's own guess
        nn.init.zeros_(self.head.bias)
        self.prior_scale = nn.Parameter(torch.tensor(1.0))

    def forward(self, features: torch.Tensor, masked: torch.Tensor) -> torch.Tensor:
        b = features.shape[1]
        h = self.input(features) + self.position.weight[:b]
        h = self.norm(self.encoder(h))
        doubt = features[..., self.config.log_doubt_index] * DOUBT_SCALE  # log(1 - confidence)
        logits = self.head(h).squeeze(-1) - self.prior_scale * doubt
        return logits.masked_fill(~masked, float("-inf"))
