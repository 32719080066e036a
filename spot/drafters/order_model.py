"""SPOT's order model: which masked position does the target commit next?

A small transformer encoder over the block's positions that reads only model-agnostic
features of the *stale* distribution (the target's last exact forward) and of a hypothesis
state a few steps ahead, so one checkpoint can serve targets of any width or vocabulary.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
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
    (the most confident position was tied in 76% of sdar-tiny's steps) while float32
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
    noise = gumbel.gather(-1, top_ids.long())
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
        self.input = nn.Linear(config.num_features, config.d_model)
        self.position = nn.Embedding(config.max_block_length, config.d_model)
        layer = nn.TransformerEncoderLayer(
            config.d_model,
            config.num_heads,
            config.ff_size,
            dropout=0.0,
            batch_first=True,
            norm_first=True,
        )
        self.encoder = nn.TransformerEncoder(layer, config.num_layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(config.d_model)
        self.head = nn.Linear(config.d_model, 1)
        nn.init.zeros_(self.head.weight)  # untrained, the model is the rule's own guess
        nn.init.zeros_(self.head.bias)
        self.prior_scale = nn.Parameter(torch.tensor(1.0))

    def forward(self, features: torch.Tensor, masked: torch.Tensor) -> torch.Tensor:
        b = features.shape[1]
        positions = torch.arange(b, device=features.device)
        h = self.input(features) + self.position(positions)
        h = self.norm(self.encoder(h))
        doubt = features[..., self.config.log_doubt_index] * DOUBT_SCALE  # log(1 - confidence)
        logits = self.head(h).squeeze(-1) - self.prior_scale * doubt
        return logits.masked_fill(~masked, float("-inf"))
