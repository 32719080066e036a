"""The speculative benchmark: walk-stop classification on a hand-written tree, interleaved rows."""

import importlib.util
import sys
from pathlib import Path

import torch

from spot.tree import DraftTree, Layout, State, advance

M = 11  # mask id
spec = importlib.util.spec_from_file_location(
    "bench_speculative", Path(__file__).parents[1] / "bench" / "speculative.py"
)
bench = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = bench  # dataclasses look their module up there
spec.loader.exec_module(bench)


def test_each_reason_a_walk_stops_is_told_apart():
    lay = Layout.for_prompt(4, 4, 4, 4, False, M, (10,))
    root = State(4, torch.tensor([5, M, M, M]), 1, 1)
    a = advance(lay, root, torch.tensor([5, 7, M, M]))
    b = advance(lay, a, torch.tensor([5, 7, 8, M]))
    tree = DraftTree((root, a, b), (-1, 0, 1))
    at = torch.tensor([False, True, False, False])  # the target commits position 1
    at_3 = torch.tensor([False, False, False, True])

    def stop(path, commits, ended=False):
        return bench.walk_stop(tree, path, commits, ended, M)

    assert bench.walk_stop(DraftTree.single(root), [0], at, False, M) == "no draft"
    assert stop([0], at_3) == "order"  # the only child commits position 1
    assert stop([0], at) == "token"  # it does commit position 1: with another token
    assert stop([0, 1, 2], at_3) == "budget"  # a leaf
    # the target's transition from b completes the request: nothing was left to draft
    assert stop([0, 1, 2], at_3, ended=True) == "end"
    assert stop([0], at, ended=True) == "end"


def test_interleaved_rows_keep_each_decoder_apart():
    """Decoders take turns batch by batch; each row still holds its own decoder's outputs in
    request order, and walks are classified only for rows that ask for it."""
    from pipeline.drafter_data import corpus_prompts, encode, load_model_and_tokenizer
    from spot.builtin import builtin_drafter
    from spot.config import DecodingConfig
    from spot.decode import generate
    from spot.drafters.registry import load_drafter

    tokenizer, target = load_model_and_tokenizer("builtin:sdar-tiny")
    requests = encode(tokenizer, corpus_prompts("heldout", 3))
    config = DecodingConfig(gen_length=32, block_length=16)
    spot = load_drafter("spot", builtin_drafter("sdar-tiny", "spot", 16, "static"), 4, target)
    commits, ends = {}, set()

    def record(index, state, logits, successor, hidden):
        width = state.span.numel()
        before, after = state.block(16), successor.span[width - 16 : width]
        commits[requests[index].key, state.step] = (before == M) & (after != before)
        if successor.done:
            ends.add((requests[index].key, state.step))

    M = target.mask_id
    for i, r in enumerate(requests):
        generate(target, [r], config, trace=lambda _, *a, i=i: record(i, *a))
    variants = [
        bench.Variant("draft-free", "0", config),
        bench.Variant("SPOT", "4", config, spot),
        bench.Variant("SPOT unclassified", "4", config, spot, classify=False),
    ]
    rows = bench.run(variants, target, requests, 1, commits, ends)
    alone = {
        d: [generate(target, [r], config, drafter=d)[0] for r in requests] for d in (None, spot)
    }
    assert [row.outputs for row in rows] == [[r.tokens.tolist() for r in alone[None]]] * 3
    assert rows[0].nfe == [r.stats.nfe for r in alone[None]]
    assert rows[1].nfe == rows[2].nfe == [r.stats.nfe for r in alone[spot]] != rows[0].nfe
    assert rows[1].stops.total() == sum(rows[1].nfe) and not rows[2].stops
