"""The continuous-batching benchmark: rows that take turns keep their own outputs and stats."""

import importlib.util
import sys
from pathlib import Path

from spot.config import DecodingConfig
from spot.decode import generate
from tests.random_drafter import RandomDrafter
from tests.test_decode_loop import make_requests
from tests.toy import ToyTarget

spec = importlib.util.spec_from_file_location(
    "bench_continuous_batching", Path(__file__).parents[1] / "bench" / "continuous_batching.py"
)
bench = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = bench  # dataclasses look their module up there
spec.loader.exec_module(bench)


def test_rows_taking_turns_hold_their_own_decoders_outputs():
    target = ToyTarget(seed=1, sharpness=2.0)
    config = DecodingConfig(gen_length=24, block_length=4)
    requests = make_requests([2, 7, 4, 9, 1, 6, 3])
    rows = [
        bench.Row("draft-free", "static", 3),
        bench.Row("draft-free", "continuous", 3),
        bench.Row("random", "static", 3, RandomDrafter(seed=1)),
        bench.Row("random", "continuous", 3, RandomDrafter(seed=1)),
    ]
    bench.take_turns(rows, target, requests, config)
    alone = [r.tokens.tolist() for r in generate(target, requests, config)]
    for row in rows:
        assert row.outputs() == alone and row.seconds > 0
    per_forward = [bench.requests_per_forward(x.stats for x in r.results.values()) for r in rows]
    assert per_forward[1] > per_forward[0] and per_forward[3] > per_forward[2]
    text = bench.table(rows, target.eos_ids, "### toy")
    assert text.count("| yes |") == 4 and "| 3 | random | continuous |" in text
