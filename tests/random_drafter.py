"""A drafter that guesses at random, sometimes right: the exactness oracle for the loop.

Each child is its parent after one drafted transition: usually the commit rule applied to the
stale logits (what a good drafter would guess), sometimes a random masked position with a
random token. Trees may cross block ends. Whatever it proposes, the decoded output must equal
draft-free decoding.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from spot.commit import commit_rule
from spot.drafting import Drafter, DraftInput, StepNoise
from spot.noise import step_key
from spot.tree import DraftTree, State, advance


class RandomDrafter(Drafter):
    def __init__(self, seed: int = 0, max_nodes: int = 8, guess_rate: float = 0.7):
        self.seed = seed
        self.max_nodes = max_nodes
        self.guess_rate = guess_rate

    def propose(
        self, inputs: Sequence[DraftInput], noise: StepNoise, batch_size: int
    ) -> list[DraftTree]:
        return [self._tree(inp, noise) for inp in inputs]

    def _tree(self, inp: DraftInput, noise: StepNoise) -> DraftTree:
        g = torch.Generator().manual_seed(step_key(self.seed, inp.key, inp.root.step))
        layout = inp.layout
        b = layout.block_length
        nodes: list[State] = [inp.root]
        parent = [-1]
        size = int(torch.randint(1, self.max_nodes + 1, (1,), generator=g))
        while len(nodes) < size:
            open_nodes = [i for i, n in enumerate(nodes) if not n.done]
            if not open_nodes:
                break
            p = open_nodes[int(torch.randint(len(open_nodes), (1,), generator=g))]
            node = nodes[p]
            block = node.block(b)
            same_block = node.block_start(b) == inp.stale_state.block_start(b)
            if same_block and float(torch.rand((), generator=g)) < self.guess_rate:
                k = torch.tensor([layout.commit_count(node.block_start(b), node.block_step)])
                gumbel = noise.gumbel(inp.key, node.step, inp.stale_logits)
                next_block = commit_rule(
                    block[None],
                    inp.stale_logits[None],
                    None if gumbel is None else gumbel[None],
                    k,
                    inp.config,
                    layout.mask_id,
                    inp.confidence,
                )[0]
            else:
                masked = (block == layout.mask_id).nonzero().flatten()
                pos = masked[int(torch.randint(masked.numel(), (1,), generator=g))]
                next_block = block.clone()
                vocab = inp.stale_logits.shape[-1]
                next_block[pos] = int(torch.randint(vocab, (1,), generator=g))
            nodes.append(advance(layout, node, next_block))
            parent.append(p)
        return DraftTree(tuple(nodes), tuple(parent))
