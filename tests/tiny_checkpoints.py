"""Tiny random checkpoints of the native families, written in their original on-disk format.

Weights are drawn from a seeded generator and scaled so that predictions are peaked enough to
give confident and unconfident positions. The EOS output row is a scaled sum of three others,
so EOS wins now and then; the mask token's output row is the mean of the others, so its logit
is never the largest and decoding always progresses.
"""

from __future__ import annotations

from pathlib import Path

import torch

from spot.models.registry import family_for
from spot.models.transformer import Transformer, TransformerConfig

VOCAB = 300
MASK_ID = 299
EOS_IDS = (298, 297)


def tiny_config(family: str, **overrides) -> TransformerConfig:
    """A few layers, hidden 32, vocab 300, in the family's architecture."""
    base = {
        "vocab_size": VOCAB,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_layers": 2,
        "num_heads": 4,
        "num_kv_heads": 2,
        "head_dim": 8,
        "max_position_embeddings": 512,
    }
    if family == "sdar":
        base.update(qk_norm=True, rope_theta=10000.0, rms_norm_eps=1e-6)
    elif family == "llada":
        base.update(num_kv_heads=4, rope_full_precision=True, rope_theta=500000.0)
        base.update(rms_norm_eps=1e-5)
    base.update(overrides)
    return TransformerConfig(**base)


def random_model(
    family: str, seed: int = 0, dtype: torch.dtype = torch.float64, **overrides
) -> Transformer:
    fam = family_for(family)
    config = tiny_config(family, **overrides)
    model = fam.build(config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=generator))
            elif p.dim() == 2:
                fan_in = p.shape[1] if "embed" not in name else 1
                p.copy_(torch.randn(p.shape, generator=generator) * 1.5 / fan_in**0.5)
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=generator))
        head = model.lm_head.weight
        others = torch.ones(config.vocab_size, dtype=torch.bool)
        others[MASK_ID] = False
        head[EOS_IDS[0]] = 1.15 * head[:3].sum(0)
        head[MASK_ID] = head[others].mean(0)
    return model.to(dtype).eval()


def write_checkpoint(
    directory: Path,
    family: str,
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
    **overrides,
) -> Path:
    from spot.models.loading import save_checkpoint

    model = random_model(family, seed, dtype, **overrides)
    return save_checkpoint(directory, family_for(family), model, MASK_ID, EOS_IDS)
