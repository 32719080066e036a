"""What a drafter sees and shares with the decode loop: one value per request to draft for
(`DraftInput`), the coupled noise of the decode run (`StepNoise`, a cache passed explicitly)
and the interface every drafter implements (`Drafter`).

Drafters import this module, not the decode loop; the loop knows drafters only through it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from spot import noise
from spot.commit import SamplingScores, pick_tokens, sampling_scores
from spot.config import ConfidenceName, DecodingConfig
from spot.tree import DraftTree, Layout, State


@dataclass(frozen=True, eq=False)
class DraftInput:
    """What a drafter sees of one request in one iteration: the root to grow a tree from and
    the stale logits (the target's last exact logits, for the state before the root).

    A value: nothing in it changes. Compared by identity (it holds tensors), which is how
    `StepNoise` keeps the draws made from its stale logits."""

    layout: Layout
    root: State
    stale_state: State
    stale_logits: torch.Tensor  # [B, V] on the target's device
    stale_hidden: torch.Tensor | None  # [B, H] there, when the drafter `needs_hidden`
    key: int  # the request's coupled-noise key
    config: DecodingConfig
    confidence: ConfidenceName


class StepNoise:
    """The coupled noise one decode run shares between its drafter and its commit rule.

    Made by the decode loop and passed explicitly to `Drafter.propose` and to the commit rule,
    so that the rule verifies a tree with the very tensors its tokens were drafted with. It
    is a cache, and the one mutable thing a drafter is handed:
    - Gumbel noise g[t] [B, V] per (request key, step), drawn once (a draw over the whole
      vocabulary, docs/benchmarks.md §6.1) and kept while the step is not
      behind its request's root: a tree drafts from its root's step on, so the steps one tree
      drafted past its accepted path come back in the next tree;
    - per `DraftInput`, the tokens and confidences drawn from its stale logits at each step,
      kept for the iteration (the next forward brings new stale logits).
    `keep_ahead` moves it on to the next iteration."""

    def __init__(self, seed: int, temperature: float):
        self.seed = seed
        self.temperature = temperature
        self._gumbel: dict[tuple[int, int], torch.Tensor] = {}  # (key, step) -> [B, V]
        self._draws: dict[DraftInput, _Draws] = {}

    def gumbel(self, key: int, step: int, like: torch.Tensor) -> torch.Tensor | None:
        """Noise g[step] of request `key`, of the shape [B, V] of `like`'s last two dims and
        on its device; None at T=0, where no noise enters."""
        if self.temperature == 0.0:
            return None
        if (key, step) not in self._gumbel:
            shape = tuple(like.shape[-2:])
            self._gumbel[key, step] = noise.gumbel(self.seed, key, step, shape, like.device)
        return self._gumbel[key, step]

    def noise_step(self, step: int) -> int:
        """The step whose noise a draw at `step` uses: 0 for every step at T=0, where no noise
        enters, so that draws are made (and kept) once."""
        return 0 if self.temperature == 0.0 else step

    def draw(self, inp: DraftInput, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens [B] and confidences [B] the commit rule would take from `inp`'s stale logits
        at `step` (the target's own draw if its distribution has not moved). Drawn where the
        logits are, returned on the CPU, where drafters build their trees."""
        draws = self._draws.get(inp)
        if draws is None:
            c = inp.config
            prepared = sampling_scores(
                inp.stale_logits,
                c.temperature,
                c.top_k,
                c.top_p,
                inp.confidence,
                inp.layout.mask_id,
            )
            draws = self._draws[inp] = _Draws(prepared, {})
        step = self.noise_step(step)
        if step not in draws.by_step:
            tokens, conf = pick_tokens(draws.prepared, self.gumbel(inp.key, step, inp.stale_logits))
            draws.by_step[step] = (tokens.cpu(), conf.cpu())
        return draws.by_step[step]

    def steps(self, key: int) -> list[int]:
        """The steps of request `key` whose Gumbel noise is held, in order."""
        return sorted(s for k, s in self._gumbel if k == key)

    def keep_ahead(self, roots: Iterable[tuple[int, int]]) -> None:
        """Move on to the next iteration, whose roots are `roots` ((request key, step) of
        every request still decoding): keep the noise of steps not behind a root, forget the
        rest and every draw from this iteration's stale logits."""
        first: dict[int, int] = {}  # request key -> its earliest root step
        for key, step in roots:
            first[key] = min(step, first.get(key, step))
        self._gumbel = {(k, s): g for (k, s), g in self._gumbel.items() if s >= first.get(k, s + 1)}
        self._draws.clear()


@dataclass
class _Draws:
    """One input's stale logits prepared for sampling once (every drafted step draws from
    them; preparing them per step doubled a step's cost) and its draws by step."""

    prepared: SamplingScores
    by_step: dict[int, tuple[torch.Tensor, torch.Tensor]]


class Drafter:
    """What the decode loop asks of a drafter; subclass it (the defaults below are the
    optional members).

    needs_hidden: the stale logits come with the target's last hidden states
      (`DraftInput.stale_hidden`); SPOT-Sets reads them."""

    needs_hidden: bool = False

    def propose(
        self, inputs: Sequence[DraftInput], noise: StepNoise, batch_size: int
    ) -> list[DraftTree]:
        """One tree per input, rooted at input.root (node 0). noise: the run's coupled noise,
        which the commit rule will verify the trees with; batch_size: the requests of the
        forward that verifies them (the inputs, and any with no stale logits yet)."""
        raise NotImplementedError

    def observe_forward(self, seconds: float, steps: float) -> None:
        """Called after every forward that verified a proposal, with the seconds the
        verification took (the target's forward and the commit rule, which reads its result on
        the CPU, so a GPU forward is waited for) and the mean steps the proposal's requests
        advanced: what `drafter.budget: auto` learns from. Nothing by default."""


class BudgetedDrafter(Drafter):
    """A drafter whose tree size is a node budget, given per call (`draft`), so that
    `budget.AutoBudget` can choose it each iteration without changing the drafter; `propose`
    drafts with the drafter's own `budget`."""

    budget: int

    def draft(self, inputs: Sequence[DraftInput], noise: StepNoise, budget: int) -> list[DraftTree]:
        """One tree per input with at most `budget` drafted nodes (0: the root alone)."""
        raise NotImplementedError

    def propose(
        self, inputs: Sequence[DraftInput], noise: StepNoise, batch_size: int
    ) -> list[DraftTree]:
        return self.draft(inputs, noise, self.budget)


class DrafterSlot(Drafter):
    """The drafter a decode loop holds while the drafter itself may be replaced (a job that
    learns its drafter hands each new one to its replicas): `put` from any thread; the loop
    takes the new one at its next `propose`, so a swap falls between two iterations.

    Lossless whatever it holds (docs/design.md §1.6): a drafter only proposes states, the
    commit rule gives every scored state's exact successor with the run's coupled noise (a
    function of the seed, the request key and the step, not of the drafter), and the walk
    accepts a proposed state only where it equals that successor. A request decoded partly
    with one drafter and partly with another (or none: an empty slot proposes the root
    alone) has the target's own tokens."""

    def __init__(self, drafter: Drafter | None = None, needs_hidden: bool = False):
        """needs_hidden: whether any drafter it will hold reads hidden states (the loop asks
        for them once, when it starts)."""
        self.needs_hidden = needs_hidden or bool(drafter and drafter.needs_hidden)
        self._lock = threading.Lock()
        self._next: Drafter | None = drafter
        self._replaced = True
        self._taken = 0  # drafters the loop has taken, the first one included
        self.current: Drafter | None = None  # the drafter of the last proposal

    def put(self, drafter: Drafter | None) -> None:
        """Hand over a drafter (None: draft-free from the next iteration)."""
        if drafter is not None and drafter.needs_hidden and not self.needs_hidden:
            raise ValueError("this slot was made for drafters that read no hidden states")
        with self._lock:
            self._next, self._replaced = drafter, True

    @property
    def swaps(self) -> int:
        """Drafters the loop took after its first."""
        return max(0, self._taken - 1)

    @property
    def latest(self) -> Drafter | None:
        """The drafter the next proposal uses."""
        with self._lock:
            return self._next if self._replaced else self.current

    def propose(
        self, inputs: Sequence[DraftInput], noise: StepNoise, batch_size: int
    ) -> list[DraftTree]:
        with self._lock:
            if self._replaced:
                self.current, self._replaced = self._next, False
                self._taken += 1
        if self.current is None:
            return [DraftTree.single(inp.root) for inp in inputs]
        return self.current.propose(inputs, noise, batch_size)

    def observe_forward(self, seconds: float, steps: float) -> None:
        if self.current is not None:
            self.current.observe_forward(seconds, steps)
