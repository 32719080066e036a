"""The commit-rule benchmark: its job variants, its statistics, and its scoring through the job's
engine against `spot-factory evaluate-target`'s on the same prompts."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from spot_common.corpus import heldout_prompts, is_correct
from spot_factory.target_quality import evaluate

spec = importlib.util.spec_from_file_location(
    "bench_decoding_rules", Path(__file__).parents[1] / "bench" / "decoding_rules.py"
)
bench = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = bench  # dataclasses look their module up there
spec.loader.exec_module(bench)


def test_exact_mcnemar_and_wilson_by_hand():
    assert bench.mcnemar_p(0, 0) == 1.0
    assert bench.mcnemar_p(3, 3) == 1.0
    assert bench.mcnemar_p(0, 6) == pytest.approx(2 / 64)  # 6 flips all one way
    assert bench.mcnemar_p(1, 6) == pytest.approx(2 * 8 / 128)
    assert bench.mcnemar_p(6, 1) == bench.mcnemar_p(1, 6)
    low, high = bench.wilson(0, 10)
    assert low == 0.0 and high == pytest.approx(0.2775, abs=1e-4)
    low, high = bench.wilson(115, 200)  # 57.5%
    assert (low, high) == (pytest.approx(0.5058, abs=1e-4), pytest.approx(0.6414, abs=1e-4))
    assert bench.paired_difference(0, 0, 200) == (0.0, 0.0)
    diff, half = bench.paired_difference(3, 0, 200)
    assert diff == -0.015 and half == pytest.approx(1.96 * ((0.015 - 0.015**2) / 200) ** 0.5)


def test_more_prompts_than_the_bundled_maths_continue_the_held_out_set(tmp_path):
    assert bench.heldout_input(314, tmp_path) == "builtin:prompts/heldout.jsonl"
    path = bench.heldout_input(320, tmp_path, examples=450)
    variants = bench.make_variants("sdar-nano", 8, [f"input.path={path}"], drafters=False)
    assert [v.drafter for v in variants] == ["none"] * 5
    rows = bench.maths_rows(variants[0].job, 320)
    ids = rows.column("id").to_pylist()
    assert ids[:314] == [p["id"] for p in heldout_prompts(["math"], 320)] and len(set(ids)) == 320
    with pytest.raises(ValueError, match="holds 3.. maths problems, not 500"):
        bench.maths_rows(variants[0].job, 500)


def test_variants_are_the_drafters_the_registry_serves_each_rule_with():
    variants = bench.make_variants("sdar-tiny", 8, [])
    kinds = {}
    for v in variants:
        kinds.setdefault(v.rule.label, []).append(v.drafter)
        assert v.job.resources.batch_size == 8 and v.job.input.limit is None
        assert v.job.decoding.rule == v.rule.rule and v.job.decoding.threshold == v.rule.threshold
        assert v.job.drafter.budget == ("auto" if v.drafter != "none" else v.job.drafter.budget)
    assert kinds == {
        "static": ["none", "spiffy", "spot"],
        "threshold 0.9": ["none", "spiffy", "spot-sets"],
        "threshold 0.7": ["none", "spiffy", "spot-sets"],
        "sdar_dynamic 0.9": ["none"],
        "sdar_dynamic 0.9, 2/step": ["none"],  # no bundled drafter for the rule
    }
    llada = bench.make_variants("llada-tiny", 1, [])
    assert {v.rule.rule for v in llada} == {"static", "threshold"}
    assert all(v.job.model.family == "llada" for v in llada)


@pytest.fixture
def without_gradients():
    """Decoding as the benchmark does, gradients off, for this test only."""
    with torch.no_grad():
        yield


def test_engine_completions_score_as_evaluate_target_does(without_gradients):
    """Static draft-free decoding through the job's engine writes the completions
    `evaluate-target` writes for the same held-out maths prompts; variants taking turns in
    chunks, twice over, keep their rows in order, and a drafted variant matches its rule's
    draft-free decoding."""
    base = ["decoding.gen_length=32", "decoding.block_length=16"]
    chosen = {("static", "none"), ("threshold 0.9", "none"), ("threshold 0.9", "spiffy")}
    variants = [
        v for v in bench.make_variants("sdar-nano", 3, base) if (v.rule.label, v.drafter) in chosen
    ]
    rows = bench.maths_rows(variants[0].job, 7)
    for v in variants:
        v.start()
    bench.take_turns(variants, rows, chunk=3, passes=2)
    for v in variants:
        assert [len(p) for p in v.passes] == [3, 3] and len(v.chunk_rates) == 6
        assert v.table.column("id") == rows.column("id") and v.repeatable()
        assert v.start_cpu_seconds > 0

    static = variants[0]
    prompts = heldout_prompts(["math"], 7)
    _, completions = evaluate(
        "sdar-nano", static.engine.target, static.engine.tokenizer, prompts, 16, 32
    )
    assert static.table.column("completion").to_pylist() == completions
    assert static.correct() == [is_correct(p, c) for p, c in zip(prompts, completions)]
    text = bench.report(variants, "### sdar-nano")
    assert "| threshold 0.9 | Spiffy |" in text and text.splitlines()[-1].endswith("| yes |")
