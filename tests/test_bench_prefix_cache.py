"""The prefix-cache benchmark on a tiny SDAR: rows with and without the cache, behind a long
and a short shared prefix, keep their own outputs and report what they reused."""

import importlib.util
import sys
from pathlib import Path

import torch

from spot.config import DecodingConfig
from spot.decode import Request
from spot.models.loading import load_target
from spot.models.prefix_cache import PrefixCache
from tests.tiny_checkpoints import write_checkpoint

spec = importlib.util.spec_from_file_location(
    "bench_prefix_cache", Path(__file__).parents[1] / "bench" / "prefix_cache.py"
)
bench = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = bench  # dataclasses look their module up there
spec.loader.exec_module(bench)


def test_rows_report_reuse_and_keep_their_outputs(tmp_path):
    target = load_target(write_checkpoint(tmp_path, "sdar", 11))
    config = DecodingConfig(gen_length=8, block_length=4)
    g = torch.Generator().manual_seed(0)
    questions = [torch.randint(0, 290, (n,), generator=g) for n in (5, 7, 6, 9, 3)]
    systems = {"short": torch.arange(1, 3), "long": torch.arange(10, 40)}
    requests = {
        name: [Request(torch.cat([system, q]), key=i) for i, q in enumerate(questions)]
        for name, system in systems.items()
    }
    rows = [
        bench.Row("draft-free", 2, system, PrefixCache(1 << 20, 4) if cached else None)
        for system in ("short", "long")
        for cached in (False, True)
    ]
    bench.take_turns(rows, target, requests, config)
    lengths = {"short": "2 tokens", "long": "30 tokens"}
    lines = bench.table(rows, target.eos_ids, lengths, True, "# heading").splitlines()
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines[4:]]
    assert [c[2:4] for c in cells] == [
        ["short (2 tokens)", "off"],
        ["short (2 tokens)", "on"],
        ["long (30 tokens)", "off"],
        ["long (30 tokens)", "on"],
    ]
    assert [c[-1] for c in cells] == ["yes"] * 4
    assert [c[6] for c in cells[:2]] == ["1.00", "1.00"]  # short over itself
    reused = [int(c[12]) for c in cells]
    assert reused[2] == 0 and reused[3] >= 4 * 28  # the long prefix's 7 whole blocks, again
