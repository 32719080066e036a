"""The one decode loop on a toy target: speculative == draft-free, batch invariance, stats,
continuous batching."""

import itertools
import weakref

import pytest
import torch

from spot.config import DecodingConfig
from spot.decode import Request, generate, requests_per_forward, stream
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


def case(rule, temperature, absolute) -> tuple[ToyTarget, DecodingConfig]:
    """A toy target and a decoding of 2 tokens per step under `rule`."""
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
    return target, config


@pytest.mark.parametrize("rule,temperature,absolute", CASES)
def test_random_trees_change_nothing(rule, temperature, absolute):
    target, config = case(rule, temperature, absolute)
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


# -- continuous batching -------------------------------------------------------------------------
class Counting(ToyTarget):
    """The toy target, counting the requests of each forward and keeping track of the contexts
    still open (a context is let go once nothing refers to it)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.requests_per_forward: list[int] = []
        self.opened: list[weakref.ref] = []

    def open(self, prompt, total_length):
        context = super().open(prompt, total_length)
        self.opened.append(weakref.ref(context))
        return context

    @property
    def live(self) -> int:
        return sum(ref() is not None for ref in self.opened)

    def score(self, contexts, windows, block_length, output_hidden=False):
        self.requests_per_forward.append(len(contexts))
        return super().score(contexts, windows, block_length, output_hidden)


MAX_ACTIVE = [1, 3, 8, None]
# requests that end at different iterations (EOS): 20, 12, 16, 4, 8, 4 and 16 forwards
VARIED = dict(seed=1, sharpness=2.0), DecodingConfig(gen_length=24, block_length=4)


@pytest.mark.parametrize("rule,temperature,absolute", CASES)
@pytest.mark.parametrize("drafted", [False, True])
def test_continuous_batching_decodes_each_request_as_a_static_batch_does(
    rule, temperature, absolute, drafted
):
    """Requests of different lengths finish at different iterations and waiting ones take
    their places, each at its own block and step: tokens, finish reasons, steps and forwards
    per request are those of one static batch of all of them."""
    target, config = case(rule, temperature, absolute)
    requests = make_requests([3, 8, 13, 5, 1, 9, 4, 11, 7, 2])
    drafter = RandomDrafter(seed=5, max_nodes=6) if drafted else None
    static = generate(target, requests, config, drafter)
    assert len({r.stats.nfe for r in static}) > 1  # requests do finish at different times
    for max_active in MAX_ACTIVE:
        continuous = generate(target, requests, config, drafter, max_active=max_active)
        assert tokens(continuous) == tokens(static)
        assert [r.finish_reason for r in continuous] == [r.finish_reason for r in static]
        for s, c in zip(static, continuous):
            per_request = (c.stats.steps, c.stats.nfe, c.stats.tree_nodes)
            assert per_request == (s.stats.steps, s.stats.nfe, s.stats.tree_nodes)


def test_a_finished_requests_place_goes_to_the_next_waiting_one_at_once():
    """`stream` takes a request from its input only when a place is free, yields results as
    requests finish, and lets a finished request's target context go."""
    target, config = Counting(**VARIED[0]), VARIED[1]
    alone = ToyTarget(**VARIED[0])
    requests = make_requests([2, 7, 4, 9, 1, 6, 3])
    taken = []

    def arriving():
        for r in requests:
            taken.append(r)
            yield r

    finished = []
    for index, result in stream(target, arriving(), config, max_active=3):
        finished.append(index)
        assert len(taken) <= 3 + len(finished) - 1  # taken once a place is free
        assert target.live <= 3 - 1  # the finished one's context is gone
        assert result.tokens.tolist() == tokens(generate(alone, [requests[index]], config))[0]
    assert sorted(finished) == list(range(len(requests))) and finished != sorted(finished)
    # every forward but the last few holds 3 requests: a place never stays empty while
    # requests wait
    counts = target.requests_per_forward
    short = next(i for i, n in enumerate(counts) if n < 3)
    assert set(counts[:short]) == {3} and counts[short:] == sorted(counts[short:], reverse=True)


@pytest.mark.parametrize("max_active", [2, 3, None])
def test_requests_per_forward_is_the_mean_over_the_target_forwards(max_active):
    target, config = Counting(**VARIED[0]), VARIED[1]
    results = generate(target, make_requests([2, 7, 4, 9, 1, 6, 3]), config, max_active=max_active)
    counts = target.requests_per_forward
    assert requests_per_forward(r.stats for r in results) == pytest.approx(
        sum(counts) / len(counts)
    )
    assert sum(r.stats.nfe for r in results) == sum(counts)


def test_the_drafter_is_told_the_requests_of_the_forward_not_only_those_drafted_for():
    """A request admitted in this iteration has no stale logits yet and gets no tree, but it
    is in the forward: `batch_size` counts it (what `budget: auto`'s search is keyed by)."""
    target, config = Counting(**VARIED[0]), VARIED[1]
    seen = []

    class Recording(RandomDrafter):
        def propose(self, inputs, noise, batch_size):
            seen.append((batch_size, len(inputs), len(target.requests_per_forward)))
            return super().propose(inputs, noise, batch_size)

    generate(target, make_requests([2, 7, 4, 9, 1, 6, 3]), config, Recording(), max_active=3)
    counts = target.requests_per_forward
    assert all(size == counts[forward] for size, _, forward in seen)
    assert any(drafting < size for size, drafting, _ in seen)  # newcomers mid-way


def test_max_active_must_be_positive():
    with pytest.raises(ValueError, match="max_active"):
        generate(ToyTarget(), make_requests([3]), DecodingConfig(16, 4), max_active=0)
