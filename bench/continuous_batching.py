"""Static batches against continuous batching, draft-free and with SPOT `budget: auto`, on
the bundled held-out prompts.

    OMP_NUM_THREADS=1 .venv/bin/python bench/continuous_batching.py --prompts 400

Per batch size B (8 and 32), four rows decode the same prompts:
- static: the prompts in chunks of B, each chunk decoded until its last request finishes
  (a batch that shrinks as its requests finish), as a replica did before;
- continuous: B requests decode at once and a finished request's place goes to the next
  prompt at once (`spot.decode.stream` with max_active=B).
Ratios are what to read: the rows take turns, one finished request each, in rotation, so a
slow spell of the shared machine falls on every row alike. Columns: tokens/s (generated
tokens before the first EOS) and continuous over static for the same decoder, the same per
second of this process's CPU time (steadier than wall time while others load the machine),
and the mean number of requests per target forward.
"""

from __future__ import annotations

import argparse
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from pipeline.drafter_data import corpus_prompts, encode, load_model_and_tokenizer
from spot.budget import AutoBudget, measure_forward_cost
from spot.builtin import builtin_drafter
from spot.config import DecodingConfig
from spot.decode import Request, Result, requests_per_forward, stream
from spot.drafters.registry import acceptance_curve, load_drafter
from spot.drafting import Drafter
from spot.models.loading import DTYPES


@dataclass
class Row:
    """One decoder with one kind of batching, and what it measured."""

    decoder: str
    batching: str  # "static" | "continuous"
    batch_size: int
    drafter: Drafter | None = None
    results: dict[int, Result] = field(default_factory=dict)
    seconds: float = 0.0
    cpu_seconds: float = 0.0  # this process's CPU time in the row's turns

    def decode(self, target, requests: Sequence[Request], config) -> Iterator[tuple[int, Result]]:
        if self.batching == "continuous":
            yield from stream(target, requests, config, self.drafter, max_active=self.batch_size)
            return
        for start in range(0, len(requests), self.batch_size):
            chunk = requests[start : start + self.batch_size]
            for index, result in stream(target, chunk, config, self.drafter):
                yield start + index, result

    def outputs(self) -> list[list[int]]:
        return [self.results[i].tokens.tolist() for i in sorted(self.results)]


def take_turns(rows: list[Row], target, requests: Sequence[Request], config) -> None:
    """Every row decodes every request; the rows advance in rotation, each by one finished
    request per turn, and each row's seconds are those of its own turns."""
    streams = {id(row): row.decode(target, requests, config) for row in rows}
    live = list(rows)
    turn = 0
    while live:
        first = turn % len(live)
        for row in live[first:] + live[:first]:
            t0, c0 = time.perf_counter(), time.process_time()
            item = next(streams[id(row)], None)
            row.seconds += time.perf_counter() - t0
            row.cpu_seconds += time.process_time() - c0
            if item is None:
                live.remove(row)
            else:
                index, result = item
                row.results[index] = result
        turn += 1


def generated_tokens(result: Result, eos_ids: Sequence[int]) -> int:
    """Tokens generated before the first EOS."""
    ids = result.tokens.tolist()
    return next((i for i, t in enumerate(ids) if t in eos_ids), len(ids))


def budgets_used(drafter: Drafter | None) -> str:
    """budget auto: the budgets its iterations ran at, most used first, with their shares."""
    if not isinstance(drafter, AutoBudget):
        return "–"
    used: Counter = Counter()
    for (_, budget), iterations in drafter.timed.items():
        used[budget] += iterations
    total = sum(used.values()) or 1
    return ", ".join(f"{b}: {n / total:.0%}" for b, n in used.most_common(3))


def table(rows: list[Row], eos_ids: Sequence[int], heading: str) -> str:
    lines = [
        heading,
        "",
        "| batch | decoder | batching | tokens/s | continuous / static | vs draft-free static "
        "| tokens per CPU s (ratio) | requests per forward | forwards | NFE mean "
        "| budget auto used | exact |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    reference = rows[0].outputs()
    rate, cpu_rate = {}, {}
    for r in rows:
        tokens = sum(generated_tokens(x, eos_ids) for x in r.results.values())
        rate[r.decoder, r.batching, r.batch_size] = tokens / r.seconds
        cpu_rate[r.decoder, r.batching, r.batch_size] = tokens / r.cpu_seconds
    for r in rows:
        tps = rate[r.decoder, r.batching, r.batch_size]
        static = rate[r.decoder, "static", r.batch_size]
        base = rate[rows[0].decoder, "static", r.batch_size]
        cpu = cpu_rate[r.decoder, r.batching, r.batch_size]
        cpu_static = cpu_rate[r.decoder, "static", r.batch_size]
        stats = [x.stats for x in r.results.values()]
        nfe = sum(s.nfe for s in stats)
        lines.append(
            f"| {r.batch_size} | {r.decoder} | {r.batching} | {tps:.1f} | {tps / static:.2f}x "
            f"| {tps / base:.2f}x | {cpu:.1f} ({cpu / cpu_static:.2f}x) "
            f"| {requests_per_forward(stats):.2f} "
            f"| {sum(s.forward_share for s in stats):.0f} | {nfe / len(stats):.1f} "
            f"| {budgets_used(r.drafter)} | {'yes' if r.outputs() == reference else 'NO'} |"
        )
    return "\n".join(lines)


def target_arguments(p: argparse.ArgumentParser, prompts: int, batch_sizes: list[int]) -> None:
    """The bundled target, prompts, batch sizes and decoding a batching benchmark takes."""
    p.add_argument("--target", default="sdar-tiny")
    p.add_argument("--prompts", type=int, default=prompts, help="first N held-out prompts")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=batch_sizes)
    p.add_argument("--gen-length", type=int, default=64)
    p.add_argument("--block-length", type=int, default=32)
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    p.add_argument("--device", default="cpu", help="where the target runs: cpu, cuda, auto")


def spot_auto(target, name: str, block_length: int, batch_sizes) -> Callable[[], AutoBudget]:
    """Fresh SPOT `budget: auto` drafters for the bundled target `name`, the forward cost
    measured once here for every width the batch sizes can reach, as a replica does."""
    path = builtin_drafter(name, "spot", block_length)
    curve = acceptance_curve("spot", path)
    largest = max(curve.budgets)
    widths = {1, 2, 4, 8, 16, 32}
    for b in batch_sizes:
        widths |= {b, b * (largest + 1)}
    cost = measure_forward_cost(target, block_length, 4 * block_length, sorted(widths))
    return lambda: AutoBudget(load_drafter("spot", path, largest, target), curve, cost)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    target_arguments(p, prompts=400, batch_sizes=[8, 32])
    p.add_argument("--temperature", type=float, default=0.0)
    args = p.parse_args()
    torch.set_grad_enabled(False)

    tokenizer, target = load_model_and_tokenizer(f"builtin:{args.target}", args.dtype, args.device)
    requests = encode(tokenizer, corpus_prompts("heldout", args.prompts))
    config = DecodingConfig(
        gen_length=args.gen_length, block_length=args.block_length, temperature=args.temperature
    )
    auto = spot_auto(target, args.target, args.block_length, args.batch_sizes)
    rows = []
    for b in args.batch_sizes:
        for batching in ("static", "continuous"):
            rows.append(Row("draft-free", batching, b))
        for batching in ("static", "continuous"):
            rows.append(Row("SPOT auto", batching, b, auto()))
    take_turns(rows, target, requests, config)
    heading = (
        f"### {args.target} ({args.dtype}, {target.device}) — block {config.block_length}, gen "
        f"{config.gen_length}, T={config.temperature}, {len(requests)} held-out prompts, "
        f"{torch.get_num_threads()} thread(s)"
    )
    print(table(rows, target.eos_ids, heading))


if __name__ == "__main__":
    main()
