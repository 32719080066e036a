"""The one decode loop on a toy target: speculative == draft-free, batch invariance, stats."""

import itertools

import pytest
import torch

from spot.config import DecodingConfig
from spot.decode import Request, generate
from spot.drafting import Drafter
from spot.noise import request_key
from spot.tree import DraftTree, advance
from tests.random_drafter import RandomDrafter
from tests.toy import ToyTarget


def make_requests(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        Request(torch.randint(0, 10, (n,), generator=g), request_key(f"r{i}"))
        for i, n in enumerate(lengths)
    ]


def tokens(results):
    return [r.tokens.tolist() for r in results]


class OracleDrafter(Drafter):
    """Proposes the target's own future as a chain (read from a recorded draft-free run):
    every drafted node must be accepted."""

    def __init__(self, next_blocks, depth):
        self.next_blocks = next_blocks  # key -> step -> block produced from that step's state
        self.depth = depth

    def propose(self, inputs, noise, batch_size):
        trees = []
        for inp in inputs:
            nodes, cur = [inp.root], inp.root
            for _ in range(self.depth):
                if cur.done:
                    break
                cur = advance(inp.layout, cur, self.next_blocks[inp.key][cur.step])
                nodes.append(cur)
            trees.append(DraftTree(tuple(nodes), tuple(range(-1, len(nodes) - 1))))
        return trees


CASES = list(itertools.product(["static", "threshold", "sdar_dynamic"], [0.0, 0.8], [False, True]))


@pytest.mark.parametrize("rule,temperature,absolute", CASES)
def test_random_trees_change_nothing(rule, temperature, absolute):
    target = ToyTarget(seed=1, absolute_block_grid=absolute, sharpness=2.0)
    config = DecodingConfig(
        gen_length=24,
        block_length=8,
        rule=rule,
        tokens_per_step=2,
        temperature=temperature,
        threshold=0.6,
        seed=3,
    )
    requests = make_requests([3, 8, 13, 5])
    plain = generate(target, requests, config)
    drafted = generate(target, requests, config, drafter=RandomDrafter(seed=5, max_nodes=6))
    assert tokens(drafted) == tokens(plain)
    assert [r.finish_reason for r in drafted] == [r.finish_reason for r in plain]
    for p, d in zip(plain, drafted):
        assert d.stats.steps == p.stats.steps
        assert d.stats.nfe <= p.stats.nfe
    assert sum(d.stats.nfe for d in drafted) < sum(p.stats.nfe for p in plain)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_output_does_not_depend_on_batch_size_or_order(temperature):
    target = ToyTarget(seed=2)
    config = DecodingConfig(gen_length=16, block_length=4, temperature=temperature, seed=9)
    requests = make_requests([2, 7, 4, 9, 1])
    together = tokens(generate(target, requests, config))
    alone = [tokens(generate(target, [r], config))[0] for r in requests]
    reordered = tokens(generate(target, requests[::-1], config))[::-1]
    assert together == alone == reordered


def test_seed_changes_samples_at_positive_temperature_only():
    target = ToyTarget(seed=2, sharpness=1.0)
    requests = make_requests([4, 6, 8])
    cold = [DecodingConfig(gen_length=16, block_length=4, seed=s) for s in (0, 1)]
    warm = [DecodingConfig(gen_length=16, block_length=4, temperature=1.0, seed=s) for s in (0, 1)]
    cold_out = [tokens(generate(target, requests, c)) for c in cold]
    warm_out = [tokens(generate(target, requests, c)) for c in warm]
    assert cold_out[0] == cold_out[1]
    assert warm_out[0] != warm_out[1]


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_an_oracle_chain_is_accepted_whole(temperature):
    target = ToyTarget(seed=4, sharpness=4.0)
    config = DecodingConfig(gen_length=32, block_length=8, temperature=temperature, seed=1)
    requests = make_requests([5, 9])
    next_blocks: dict[int, dict[int, torch.Tensor]] = {}

    def record(index, state, logits, successor, hidden):
        width = state.span.numel()
        produced = successor.span[width - config.block_length : width]
        next_blocks.setdefault(requests[index].key, {})[state.step] = produced

    plain = generate(target, requests, config, trace=record)
    drafted = generate(target, requests, config, drafter=OracleDrafter(next_blocks, depth=3))
    assert tokens(drafted) == tokens(plain)
    for p, d in zip(plain, drafted):
        assert p.stats.nfe == p.stats.steps
        assert d.stats.steps == p.stats.steps
        # first forward has no stale logits to draft from; then 4 steps per forward
        assert d.stats.nfe == 1 + -(-(p.stats.steps - 1) // 4)


def test_noise_of_steps_ahead_serves_the_next_tree_and_steps_behind_are_dropped():
    """The Gumbel noise a tree drew for steps its walk did not reach is the next tree's (the
    same tensors, not drawn again); no step behind a request's root is kept."""
    target = ToyTarget(seed=4)
    config = DecodingConfig(gen_length=16, block_length=4, temperature=0.8, seed=1)
    requests = make_requests([5, 9])
    seen: dict[int, list[tuple[int, dict]]] = {}

    class LookAhead(Drafter):
        def propose(self, inputs, noise, batch_size):
            for inp in inputs:
                assert all(s >= inp.root.step for s in noise.steps(inp.key))
                ahead = {
                    s: noise.gumbel(inp.key, s, inp.stale_logits)
                    for s in range(inp.root.step, inp.root.step + 3)
                }
                seen.setdefault(inp.key, []).append((inp.root.step, ahead))
            return [DraftTree.single(inp.root) for inp in inputs]

    plain = generate(target, requests, config)
    assert tokens(generate(target, requests, config, drafter=LookAhead())) == tokens(plain)
    reused = 0
    for calls in seen.values():
        assert len(calls) > 4
        for (step, ahead), (next_step, next_ahead) in zip(calls, calls[1:]):
            assert next_step == step + 1  # single-node trees: one step per forward
            for s in range(next_step, step + 3):
                assert next_ahead[s] is ahead[s]
                reused += 1
    assert reused > 0


def test_draft_free_stats_and_tail():
    target = ToyTarget(seed=0)
    config = DecodingConfig(gen_length=16, block_length=4)
    [result] = generate(target, make_requests([6]), config)
    assert result.tokens.numel() == 16
    assert result.stats.steps == result.stats.nfe == result.stats.tree_nodes
    if result.finish_reason == "eos":
        first = result.tokens.tolist().index(10)
        block_end = (first // 4 + 1) * 4
        assert result.tokens[block_end:].eq(10).all()


def test_prompt_too_long_is_rejected():
    target = ToyTarget()
    config = DecodingConfig(gen_length=16, block_length=4)
    with pytest.raises(ValueError, match="positions"):
        generate(target, make_requests([target.max_length]), config)
