"""Commit rules and coupled noise, with hand-built logits whose outcome is obvious."""

import math

import pytest
import torch

from spot import noise
from spot.commit import filter_logits, sample_tokens, select_commits, transfer_schedule

NEG = float("-inf")


def test_transfer_schedule_matches_llada_split():
    assert transfer_schedule(10, 4) == [3, 3, 2, 2]
    assert transfer_schedule(32, 32) == [1] * 32
    assert transfer_schedule(32, 16) == [2] * 16
    assert transfer_schedule(3, 8) == [1, 1, 1, 0, 0, 0, 0, 0]


def test_argmax_and_confidence_at_t0():
    logits = torch.tensor([[[0.0, 2.0, 1.0], [3.0, 0.0, 0.0]]])
    tokens, conf = sample_tokens(logits, None, 0.0)
    assert tokens.tolist() == [[1, 0]]
    expected = torch.softmax(logits.double(), -1).amax(-1)
    assert torch.equal(conf, expected)


def test_static_rule_picks_k_most_confident_masked_with_lower_index_on_ties():
    conf = torch.tensor([[0.9, 0.5, 0.5, 0.7]], dtype=torch.float64)
    masked = torch.tensor([[False, True, True, True]])
    one = select_commits(conf, masked, torch.tensor([1]), "static", 0.9)
    assert one.tolist() == [[False, False, False, True]]
    two = select_commits(conf, masked, torch.tensor([2]), "static", 0.9)
    assert two.tolist() == [[False, True, False, True]]  # tie 0.5/0.5: lower index wins
    many = select_commits(conf, masked, torch.tensor([9]), "static", 0.9)
    assert many.tolist() == [[False, True, True, True]]


def test_threshold_rule_commits_confident_set_and_always_the_best():
    conf = torch.tensor([[0.95, 0.91, 0.2, 0.9], [0.3, 0.2, 0.1, 0.4]], dtype=torch.float64)
    masked = torch.tensor([[False, True, True, True], [True, True, True, True]])
    got = select_commits(conf, masked, torch.tensor([1, 1]), "threshold", 0.9)
    assert got.tolist() == [[False, True, False, True], [False, False, False, True]]


def test_sdar_dynamic_rule_falls_back_to_top_k():
    conf = torch.tensor([[0.95, 0.5, 0.4, 0.3], [0.95, 0.96, 0.4, 0.3]], dtype=torch.float64)
    masked = torch.ones(2, 4, dtype=torch.bool)
    got = select_commits(conf, masked, torch.tensor([2, 2]), "sdar_dynamic", 0.9)
    assert got.tolist() == [[True, True, False, False], [True, True, False, False]]
    got = select_commits(conf, masked, torch.tensor([1, 1]), "sdar_dynamic", 0.9)
    assert got.tolist() == [[True, False, False, False], [True, True, False, False]]


def test_top_k_and_top_p_filters():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64))
    assert torch.isinf(filter_logits(logits, 2, None)).tolist() == [False, False, True, True]
    kept = ~torch.isinf(filter_logits(logits, None, 0.7))
    assert kept.tolist() == [True, True, False, False]
    kept = ~torch.isinf(filter_logits(logits, None, 0.4))
    assert kept.tolist() == [True, False, False, False]


def test_noise_is_keyed_not_streamed():
    a = noise.gumbel(7, noise.request_key("row-1"), 3, (4, 5))
    b = noise.gumbel(7, noise.request_key("row-1"), 3, (4, 5))
    c = noise.gumbel(7, noise.request_key("row-1"), 4, (4, 5))
    d = noise.gumbel(7, noise.request_key("row-1", sample_index=1), 3, (4, 5))
    assert torch.equal(a, b)
    assert not torch.equal(a, c) and not torch.equal(a, d)
    assert noise.request_key("row-1") == noise.request_key("row-1")
    assert noise.request_key("row-1") != noise.request_key("row-2")


def test_noise_is_the_splitmix64_stream_of_the_step_key_read_row_major():
    # the scalar reference in plain integers: the tensor version emulates unsigned 64-bit
    # arithmetic with int64 ops, whose wrap-around and arithmetic shifts this would catch
    key, vocab = noise.step_key(7, noise.request_key("row-1"), 3), 11
    g = noise.gumbel(7, noise.request_key("row-1"), 3, (5, vocab))
    expected = torch.empty(5, vocab, dtype=torch.float64)
    for p in range(5):
        for v in range(vocab):
            x = noise._splitmix64(key + (p * vocab + v) * 0x9E3779B97F4A7C15)
            expected[p, v] = -math.log(-math.log(((x >> 11) + 0.5) * 2.0**-53))
    assert torch.allclose(g, expected, rtol=1e-15, atol=0)


def test_noise_does_not_depend_on_how_the_cpu_chunks_it(monkeypatch):
    whole = noise.gumbel(3, 5, 8, (6, 1000))
    monkeypatch.setattr(noise, "_CPU_CHUNK", 1000)  # one row per chunk
    assert torch.equal(noise.gumbel(3, 5, 8, (6, 1000)), whole)
    monkeypatch.setattr(noise, "_CPU_CHUNK", 2500)  # two rows, then two, then two
    assert torch.equal(noise.gumbel(3, 5, 8, (6, 1000)), whole)
    # the extremes of a large draw stay finite and the moments are Gumbel's
    g = noise.gumbel(0, 1, 2, (4, 50_000))
    assert torch.isfinite(g).all()
    assert abs(g.mean().item() - 0.5772) < 0.01 and abs(g.var().item() - math.pi**2 / 6) < 0.03


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_noise_made_on_a_gpu_is_the_noise_made_on_the_cpu():
    on_gpu = noise.gumbel(7, 11, 3, (32, 151936), "cuda")
    assert on_gpu.device.type == "cuda"
    # the same integers; the two logarithms may round differently in the last place
    assert torch.allclose(on_gpu.cpu(), noise.gumbel(7, 11, 3, (32, 151936)), rtol=1e-14, atol=0)


def test_request_key_is_stable_across_processes_and_versions():
    # blake2b of the id: changing this breaks reproducibility of every written corpus
    assert noise.request_key("q-0") == 7390136665158179620
    assert noise.request_key(17, 2) == noise.request_key("17", 2)


def test_gumbel_max_samples_the_tempered_softmax():
    logits = torch.tensor([[[2.0, 1.0, 0.0, -1.0]]], dtype=torch.float64)
    temperature = 0.8
    draws = 4000
    counts = torch.zeros(4)
    for step in range(draws):
        g = noise.gumbel(0, 123, step, (1, 4))[None]
        token, _ = sample_tokens(logits, g, temperature)
        counts[int(token)] += 1
    expected = torch.softmax(logits[0, 0] / temperature, -1) * draws
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 16.27, (counts, expected)  # p = 0.001 with 3 degrees of freedom


def test_confidence_kinds_at_positive_temperature():
    logits = torch.tensor([[[2.0, 1.0, 0.0]]], dtype=torch.float64)
    g = torch.zeros(1, 1, 3, dtype=torch.float64)
    _, tempered = sample_tokens(logits, g, 0.5, confidence="tempered")
    _, plain = sample_tokens(logits, g, 0.5, confidence="untempered")
    assert math.isclose(float(tempered), float(torch.softmax(logits[0, 0] / 0.5, -1)[0]))
    assert math.isclose(float(plain), float(torch.softmax(logits[0, 0], -1)[0]))


def test_opening_rows_commit_the_first_masked_position_whatever_the_rule():
    from spot.commit import commit_rule
    from spot.config import DecodingConfig

    block = torch.tensor([[5, 11, 11, 11], [11, 11, 11, 11]])
    logits = torch.zeros(2, 4, 12)
    logits[:, :, 3] = torch.tensor([0.0, 1.0, 2.0, 9.0])  # position 3 is the most confident
    config = DecodingConfig(gen_length=4, block_length=4, rule="threshold", threshold=0.5)
    out = commit_rule(
        block,
        logits,
        None,
        torch.tensor([1, 1]),
        config,
        11,
        "untempered",
        torch.tensor([True, False]),
    )
    assert out.tolist() == [[5, 3, 11, 11], [11, 11, 11, 3]]


@pytest.mark.parametrize(
    ("temperature", "rule", "top_k", "top_p"),
    [(0.0, "static", None, None), (0.8, "static", 50, 0.9), (0.7, "threshold", None, 0.95)],
)
def test_commit_rule_reads_masked_positions_only(temperature, rule, top_k, top_p):
    """Seeded property: the next block is the plain definition (sample every position, then
    select among the masked ones), whatever the logits of committed positions hold (NaN
    here), row by row as in a batch."""
    from spot.commit import commit_rule
    from spot.config import DecodingConfig

    g = torch.Generator().manual_seed(7)
    n, b, v, mask_id = 9, 16, 40, 39
    config = DecodingConfig(
        gen_length=b,
        block_length=b,
        temperature=temperature,
        rule=rule,
        threshold=0.6,
        top_k=top_k,
        top_p=top_p,
    )
    for _ in range(20):
        logits = torch.randn(n, b, v, generator=g) * 4
        block = torch.randint(0, mask_id, (n, b), generator=g)
        block[torch.rand(n, b, generator=g) < torch.rand((), generator=g)] = mask_id
        u = torch.rand(n, b, v, generator=g, dtype=torch.float64)
        gumbel = None if temperature == 0.0 else -torch.log(-torch.log(u))
        k = torch.randint(1, 4, (n,), generator=g)
        tokens, conf = sample_tokens(logits, gumbel, temperature, top_k, top_p, "tempered", mask_id)
        masked = block == mask_id
        commit = select_commits(conf, masked, k, rule, 0.6)
        expected = torch.where(commit, tokens, block)
        unread = logits.masked_fill(~masked[..., None], float("nan"))
        assert torch.equal(
            commit_rule(block, unread, gumbel, k, config, mask_id, "tempered"), expected
        )
        if gumbel is not None:  # the decode loop passes one [B, V] per row, not a stack
            rows = list(gumbel.unbind(0))
            assert torch.equal(
                commit_rule(block, unread, rows, k, config, mask_id, "tempered"), expected
            )
        for i in range(n):
            row = commit_rule(
                block[i : i + 1],
                logits[i : i + 1],
                None if gumbel is None else gumbel[i : i + 1],
                k[i : i + 1],
                config,
                mask_id,
                "tempered",
            )
            assert torch.equal(row[0], expected[i])
