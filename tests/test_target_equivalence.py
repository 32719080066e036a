"""The target wrapper against full recomputation, batching against scoring alone, and the
decode loop on real native checkpoints: speculative decoding with a random drafter is
token-identical to draft-free decoding."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from spot.config import DecodingConfig
from spot.decode import Request, generate
from spot.models.loading import load_target
from spot.models.target import DiffusionTarget
from spot.target import Window
from tests import test_models_dream_llada2 as dream_llada2
from tests.random_drafter import RandomDrafter
from tests.tiny_checkpoints import EOS_IDS, MASK_ID, VOCAB, write_checkpoint

B = 4  # block length of the hand-made windows


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """SDAR and LLaDA in float64 and float32; Dream and LLaDA2.0 (tests of every family) in
    float64."""
    root = tmp_path_factory.mktemp("checkpoints")
    written = {
        (family, dtype): write_checkpoint(root / f"{family}-{dtype}", family, 11, dtype)
        for family in ("sdar", "llada")
        for dtype in (torch.float64, torch.float32)
    }
    for family in dream_llada2.FAMILIES:
        directory = root / f"{family}-{torch.float64}"
        written[family, torch.float64] = dream_llada2.write_checkpoint(directory, family, 11)
    return written


def _target(checkpoints, family, dtype=torch.float64) -> DiffusionTarget:
    return load_target(checkpoints[family, dtype])


def _tokens(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 290, (n,), generator=torch.Generator().manual_seed(seed))


def _masks(n: int) -> torch.Tensor:
    return torch.full((n,), MASK_ID, dtype=torch.long)


def _partly_masked(n: int, seed: int) -> torch.Tensor:
    block = _tokens(n, seed)
    block[torch.randperm(n, generator=torch.Generator().manual_seed(seed))[: n // 2]] = MASK_ID
    return block


class Reference:
    """Full recomputation: the request's final tokens plus a window, masks to the end for a
    bidirectional target, the family's whole-sequence mask, no cache."""

    def __init__(self, target: DiffusionTarget, prompt: torch.Tensor, total: int):
        self.target, self.final, self.total = target, prompt.clone(), total

    def logits(self, start: int, window: torch.Tensor) -> torch.Tensor:
        seq = torch.cat([self.final[:start], window])
        end = seq.numel()
        if not self.target.decoding.block_causal:
            seq = torch.cat([seq, _masks(self.total - end)])
        mask = self.target.attention_mask(seq.numel(), B)
        with torch.no_grad():
            return self.target.model.full_logits(seq[None], mask)[0, end - B : end]

    def keep(self, start: int, window: torch.Tensor, keep: int) -> None:
        self.final = torch.cat([self.final[:start], window[:keep]])


@pytest.mark.parametrize("family", ["sdar", "llada"])
def test_windows_with_keep_equal_full_recomputation(checkpoints, family):
    """Block-by-block decoding through the cache (committed blocks stored from the same
    forward that scores the next block) equals recomputing everything from scratch."""
    target = _target(checkpoints, family)
    prompt = _tokens(10, seed=1)
    total = 28
    ctx = target.open(prompt, total)
    ref = Reference(target, prompt, total)
    start = target.committed_length(ctx)
    assert start == (0 if family == "sdar" else 10)
    first = 8 if family == "sdar" else 10  # SDAR: the grid block holding the prompt's end
    head = prompt[start:first]
    steps = [
        # (windows of (tokens, keep))
        [(torch.cat([head, prompt[first:], _masks(first + B - prompt.numel())]), first - start)],
        [(_partly_masked(B, 2), 0), (_tokens(B, 3), 0), (torch.cat([_tokens(B, 4), _masks(B)]), 0)],
        [(_tokens(2 * B, 7), 0), (torch.cat([_tokens(B, 5), _partly_masked(B, 6)]), B)],
        [
            (torch.cat([_tokens(B, 8), _masks(B)]), B),
            (torch.cat([_tokens(B, 8), _tokens(B, 9)]), 0),
        ],
    ]
    for windows in steps:
        start = target.committed_length(ctx)
        batch = [Window(0, tokens, keep) for tokens, keep in windows]
        scores = target.score([ctx], batch, B, output_hidden=True)
        assert scores.logits.shape == (len(batch), B, VOCAB)
        assert scores.hidden.shape == (len(batch), B, target.hidden_size)
        for i, (tokens, _) in enumerate(windows):
            torch.testing.assert_close(
                scores.logits[i], ref.logits(start, tokens), rtol=0, atol=1e-10
            )
        for tokens, keep in windows:
            if keep:
                ref.keep(start, tokens, keep)
        assert target.committed_length(ctx) == ref.final.numel()


def _warm_contexts(target: DiffusionTarget, prompts, total: int):
    """Open each request and commit a few blocks (each alone), so caches differ in length."""
    contexts = [target.open(p, total) for p in prompts]
    for i, (ctx, p) in enumerate(zip(contexts, prompts)):
        start = target.committed_length(ctx)
        extra = (2 + i) * B - (p.numel() - start) % B
        window = torch.cat([p[start:], _tokens(extra, 20 + i)])
        target.score([ctx], [Window(0, window, window.numel() - B)], B)
    return contexts


def _candidate_windows(seed: int, shared: bool):
    """Per request: a root keeping a block, candidates one and two blocks past it; `shared`:
    the candidates start with the root's kept block, else they are one to three blocks of
    their own (nothing shared in the request's row but the cache)."""
    g = torch.Generator().manual_seed(seed)
    windows = []
    for c in range(3):
        done = _tokens(B, seed + c)
        windows.append(Window(c, torch.cat([done, _partly_masked(B, seed + 10 + c)]), B))
        for k in range(2 + c):
            first = [done] if shared else [_tokens(B, seed + 70 + 7 * c + k)][: k % 2]
            tail = _tokens(B, seed + 30 + 7 * c + k) if torch.rand((), generator=g) < 0.5 else None
            block = _partly_masked(B, seed + 50 + 7 * c + k)
            own = torch.cat(first + ([block] if tail is None else [tail, block]))
            windows.append(Window(c, own))
    return windows


@pytest.mark.parametrize("family", ["sdar", "llada"])
@pytest.mark.parametrize(("dtype", "atol"), [(torch.float64, 1e-10), (torch.float32, 1e-4)])
def test_batch_of_candidates_equals_each_alone(checkpoints, family, dtype, atol):
    target = _target(checkpoints, family, dtype)
    prompts = [_tokens(n, seed=n) for n in (3, 7, 13)]
    total = 48
    together = _warm_contexts(target, prompts, total)
    alone = _warm_contexts(target, prompts, total)
    lengths = [target.committed_length(c) for c in together]
    assert len(set(lengths)) == 3  # different cache / committed lengths in one batch
    # each round runs on caches the one before extended
    for round_seed, shared in ((100, True), (200, False), (300, True)):
        windows = _candidate_windows(round_seed, shared)
        batched = target.score(together, windows, B, output_hidden=True)
        for i, w in enumerate(windows):
            if w.keep:
                continue  # scored below with the rest of its request
            single = target.score([alone[w.context]], [replace(w, context=0)], B, True)
            torch.testing.assert_close(batched.logits[i], single.logits[0], rtol=0, atol=atol)
            torch.testing.assert_close(batched.hidden[i], single.hidden[0], rtol=0, atol=atol)
        for c in range(3):
            keepers = [(i, w) for i, w in enumerate(windows) if w.context == c and w.keep]
            for i, w in keepers:
                single = target.score([alone[c]], [replace(w, context=0)], B)
                torch.testing.assert_close(batched.logits[i], single.logits[0], rtol=0, atol=atol)
        assert [target.committed_length(c) for c in together] == [
            target.committed_length(c) for c in alone
        ]


def test_logit_shift_takes_the_previous_position(checkpoints):
    plain = _target(checkpoints, "llada")
    shifted = DiffusionTarget(plain.model, replace(plain.decoding, logit_shift=True))
    prompt = _tokens(6, seed=3)
    window = _partly_masked(B, 4)
    logits = shifted.score([shifted.open(prompt, 14)], [Window(0, window)], B).logits[0]
    seq = torch.cat([prompt, window, _masks(4)])
    with torch.no_grad():
        full = plain.model.full_logits(seq[None])[0]
    torch.testing.assert_close(logits, full[5:9], rtol=0, atol=1e-12)


def test_embed_is_the_input_embedding(checkpoints):
    target = _target(checkpoints, "sdar")
    tokens = torch.tensor([[1, 5], [7, MASK_ID]])
    expected = target.model.model.embed_tokens.weight[tokens]
    assert torch.equal(target.embed(tokens), expected)


def test_invalid_windows_are_refused(checkpoints):
    target = _target(checkpoints, "sdar")
    ctx = target.open(_tokens(8, 1), 16)
    with pytest.raises(ValueError, match="whole blocks"):
        target.score([ctx], [Window(0, _tokens(3 * B, 2), 2)], B)
    with pytest.raises(ValueError, match="current block final"):
        target.score([ctx], [Window(0, _tokens(2 * B, 2), 2 * B)], B)
    with pytest.raises(ValueError, match="past the request's total length"):
        target.score([ctx], [Window(0, _tokens(5 * B, 2))], B)
    with pytest.raises(ValueError, match="max_length"):
        target.open(_tokens(8, 1), 10_000)


# -- the decode loop on native checkpoints ----------------------------------------------------
def _requests(count: int = 3):
    lengths = (5, 11, 8, 3)[:count]
    return [Request(_tokens(n, seed=40 + n), key=1000 + i) for i, n in enumerate(lengths)]


@pytest.mark.parametrize("family", ["sdar", "llada"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_generate_end_to_end(checkpoints, family, temperature):
    target = _target(checkpoints, family)
    config = DecodingConfig(
        gen_length=16, block_length=8, tokens_per_step=2, temperature=temperature
    )
    requests = _requests(4)
    results = generate(target, requests, config)
    for request, result in zip(requests, results):
        prompt = request.prompt.numel()
        expected = -(-(prompt + 16) // 8) * 8 - prompt if family == "sdar" else 16
        assert result.tokens.numel() == expected
        assert not bool((result.tokens == MASK_ID).any())
        assert result.finish_reason in ("eos", "length")
        assert 0 < result.stats.nfe <= result.stats.steps
        if result.finish_reason == "eos":  # the blocks after the one holding EOS: EOS fill
            origin = 0 if family == "sdar" else prompt  # where the block grid starts
            eos = prompt + int((result.tokens == EOS_IDS[0]).nonzero()[0])
            block_end = origin + ((eos - origin) // 8 + 1) * 8
            assert bool((result.tokens[block_end - prompt :] == EOS_IDS[0]).all())
    # same outputs whatever the batch: alone, and in reverse order
    for i, request in enumerate(requests):
        assert torch.equal(generate(target, [request], config)[0].tokens, results[i].tokens)
    reversed_results = generate(target, requests[::-1], config)
    for a, b in zip(results, reversed_results[::-1]):
        assert torch.equal(a.tokens, b.tokens)


@pytest.mark.parametrize("family", ["sdar", "llada", *dream_llada2.FAMILIES])
@pytest.mark.parametrize("rule", ["static", "threshold"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_random_drafter_is_token_identical(checkpoints, family, rule, temperature):
    target = _target(checkpoints, family)
    config = DecodingConfig(
        gen_length=24,
        block_length=8,
        rule=rule,
        tokens_per_step=2,
        threshold=0.3,
        temperature=temperature,
        seed=5,
    )
    requests = _requests(3)
    plain = generate(target, requests, config)
    drafted = generate(target, requests, config, drafter=RandomDrafter(seed=9, max_nodes=6))
    accepted = 0
    for a, b in zip(plain, drafted):
        assert torch.equal(a.tokens, b.tokens)
        assert a.finish_reason == b.finish_reason
        assert a.stats.steps == b.stats.steps
        assert b.stats.nfe <= a.stats.nfe
        accepted += a.stats.nfe - b.stats.nfe
    assert accepted > 0  # some drafted states were right, so the check saw accepted paths
