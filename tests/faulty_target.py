"""A real target that fails as a test tells it to, for the engine's failure handling.

`FaultyTarget(target, plan)` wraps a loaded target and raises in `score` (a target forward)
as `plan` says:
- {"every": true}: every forward raises RuntimeError;
- {"poison": id}: a forward raises RuntimeError when a request it scores has token `id` in
  its prompt (one row's forward, whatever else shares it);
- {"oom_above": n}: a forward of more than n requests raises torch.OutOfMemoryError.
`tests/generation_faults/sitecustomize.py` puts the same failures into the replicas of a
real run (`SPOT_TEST_GENERATION_FAULTS` holding the plan as JSON).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def injected_failure(plan: dict[str, Any], contexts: Sequence[Any]) -> Exception | None:
    """The failure `plan` gives a forward over `contexts`, None if it gives none."""
    if plan.get("every"):
        return RuntimeError("injected failure of every forward")
    poison = plan.get("poison")
    if poison is not None and any(bool((_prompt(c) == poison).any()) for c in contexts):
        return RuntimeError(f"injected failure of a forward holding token {poison}")
    above = plan.get("oom_above")
    if above is not None and len(contexts) > above:
        return torch.OutOfMemoryError(
            f"CUDA out of memory (injected): {len(contexts)} requests, more than {above}"
        )
    return None


def _prompt(context: Any) -> torch.Tensor:
    """A context's prompt (block-causal), or its tokens (bidirectional: the prompt and
    masks)."""
    return context.prompt if hasattr(context, "prompt") else context.tokens


class FaultyTarget:
    """`target`, whose forwards fail as `plan` says (see the module docstring)."""

    def __init__(self, target: Any, plan: dict[str, Any]):
        self.target = target
        self.plan = plan
        self.forwards = 0
        self.failed = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.target, name)

    def score(self, contexts, windows, block_length, output_hidden=False):
        self.forwards += 1
        failure = injected_failure(self.plan, contexts)
        if failure is not None:
            self.failed += 1
            raise failure
        return self.target.score(contexts, windows, block_length, output_hidden)
