"""Sparse mixture-of-experts MLP with the routing of LLaDA2.0 / Ling 2.0 (BailingMoeV2).

Reference semantics (the hub modeling file `modeling_llada2_moe.py` of inclusionAI/LLaDA2.0-mini,
classes `LLaDA2MoeGate` and `LLaDA2MoeSparseMoeBlock`, inference path `moe_infer`):

1. router logits `z = x @ W_gate.T`, computed in float32 (`router_dtype: fp32`);
2. scores `s = sigmoid(z)` (`score_function: sigmoid`);
3. routing scores `r = s + expert_bias` (a per-expert buffer, `moe_router_enable_expert_bias`);
4. group-limited top-k on `r`: the experts split into `n_group` equal groups, a group's score
   is the sum of its two best `r`, the `topk_group` best groups stay, the rest get -inf, and the
   `num_experts_per_tok` best experts of what stays are chosen (in `torch.topk` order);
5. weights are the chosen experts' *unbiased* scores `s`, divided by their sum (+1e-20) when
   more than one expert is chosen (the hub code does this whatever `norm_topk_prob` says), then
   multiplied by `routed_scaling_factor`;
6. output = sum over the chosen experts of weight * expert(x), the products and the sum taken
   in the weights' dtype (float32) and cast back, plus the shared experts' output: one SwiGLU
   MLP of width `moe_intermediate_size * num_shared_experts`.

Routing is per token, without capacity limits, so a token's output does not depend on the
other tokens of the batch (up to the last bits: which tokens share an expert's matrix product
changes how it rounds). Under float64 the router runs in float64 (never below float32).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from spot.models.transformer import SwiGLU


@dataclass(frozen=True)
class MoESpec:
    hidden_size: int
    num_experts: int
    experts_per_token: int
    expert_size: int  # moe_intermediate_size
    shared_size: int  # moe_intermediate_size * num_shared_experts; 0 = no shared experts
    num_groups: int  # n_group
    groups_per_token: int  # topk_group
    scaling: float  # routed_scaling_factor

    def __post_init__(self) -> None:
        if self.num_experts % self.num_groups:
            raise ValueError("num_experts must be a multiple of n_group")
        if self.num_experts // self.num_groups < 2:
            raise ValueError("each expert group needs at least two experts (top-2 group score)")
        if not 0 < self.groups_per_token <= self.num_groups:
            raise ValueError("topk_group must be in [1, n_group]")
        if not 0 < self.experts_per_token <= self.num_experts:
            raise ValueError("num_experts_per_tok must be in [1, num_experts]")


class Router(nn.Module):
    """The gate: `weight` [E, H] and the routing-only `expert_bias` [E] (checkpoint names)."""

    def __init__(self, spec: MoESpec):
        super().__init__()
        self.spec = spec
        self.weight = nn.Parameter(torch.empty(spec.num_experts, spec.hidden_size))
        self.register_buffer("expert_bias", torch.zeros(spec.num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> chosen experts [T, k] (long) and their weights [T, k] (router dtype)."""
        dtype = torch.promote_types(x.dtype, torch.float32)
        logits = F.linear(x.to(dtype), self.weight.to(dtype))  # [T, E]
        scores = torch.sigmoid(logits)
        chosen = group_limited_topk(scores + self.expert_bias.to(dtype), self.spec)
        weights = scores.gather(-1, chosen)  # [T, k]
        if self.spec.experts_per_token > 1:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return chosen, weights * self.spec.scaling


def group_limited_topk(scores: torch.Tensor, spec: MoESpec) -> torch.Tensor:
    """scores [T, E] -> indices [T, k] of the chosen experts (step 4 of the module doc)."""
    tokens = scores.shape[0]
    grouped = scores.view(tokens, spec.num_groups, -1)  # [T, G, E/G]
    group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [T, G]
    kept_groups = group_scores.topk(spec.groups_per_token, dim=-1, sorted=False).indices
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept_groups, True)
    keep = keep.unsqueeze(-1).expand_as(grouped).reshape(tokens, -1)  # [T, E]
    masked = scores.masked_fill(~keep, float("-inf"))
    return masked.topk(spec.experts_per_token, dim=-1).indices


class StackedExperts(nn.Module):
    """The routed experts' SwiGLU weights stacked over experts: `gate_proj`, `up_proj` [E, I, H]
    and `down_proj` [E, H, I] (checkpoints store each expert on its own; the family splits
    and stacks). One tensor per projection keeps building a 256-expert model cheap."""

    def __init__(self, spec: MoESpec):
        super().__init__()
        e, h, i = spec.num_experts, spec.hidden_size, spec.expert_size
        self.gate_proj = nn.Parameter(torch.empty(e, i, h))
        self.up_proj = nn.Parameter(torch.empty(e, i, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, i))

    def forward(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        """Expert `expert` on x [T, H] -> [T, H]."""
        gate = F.linear(x, self.gate_proj[expert])
        return F.linear(F.silu(gate) * F.linear(x, self.up_proj[expert]), self.down_proj[expert])


class SparseMoE(nn.Module):
    """Routed experts plus shared experts; module names follow the original checkpoints
    (`gate`, `experts`, `shared_experts`)."""

    def __init__(self, spec: MoESpec):
        super().__init__()
        self.spec = spec
        self.gate = Router(spec)
        self.experts = StackedExperts(spec)
        self.shared_experts = (
            SwiGLU(spec.hidden_size, spec.shared_size) if spec.shared_size else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., H] -> [..., H]."""
        shape = x.shape
        flat = x.reshape(-1, shape[-1])  # [T, H]
        chosen, weights = self.gate(flat)  # [T, k], [T, k]
        k = chosen.shape[-1]
        slots = chosen.flatten()  # [T*k] expert of each (token, choice) slot
        order = slots.argsort(stable=True)
        counts = torch.bincount(slots, minlength=self.spec.num_experts).tolist()
        inputs = flat[order // k]  # [T*k, H] slots grouped by expert
        outputs = torch.empty_like(inputs)
        start = 0
        for expert, count in enumerate(counts):
            if count:
                outputs[start : start + count] = self.experts(expert, inputs[start : start + count])
            start += count
        per_slot = torch.empty_like(outputs)
        per_slot[order] = outputs
        mixed = (per_slot.view(-1, k, shape[-1]).to(weights.dtype) * weights.unsqueeze(-1)).sum(1)
        out = mixed.to(x.dtype)
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        return out.view(shape)
