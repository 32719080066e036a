"""A shared system prompt computed once per replica: the bundled held-out prompts behind a
~300-token system prompt against the same prompts behind a 6-token one, with and without the
prefix cache (`spot.models.prefix_cache`), draft-free and SPOT `budget: auto`, at batch 1
and 8, batched continuously.

    OMP_NUM_THREADS=1 .venv/bin/python bench/prefix_cache.py --prompts 48

The prompts go through the target's chat template with the system prompt as its first turn,
as a job's `input.system_prompt` does. Each row is one replica decoding every prompt with
`spot.decode.stream`; a cached row keeps its cache from its first request to its last (what a
replica holds across batches). Ratios are what to read: the rows take turns, one finished
request each (`bench/continuous_batching.py: take_turns`), so a slow spell of the shared
machine falls on every row alike.

Columns: target forwards (decode steps; not the prompt-only forwards that compute a shared
prefix once) per second of this process's CPU time in the row's turns (on a GPU, of wall
time), prefill included (steadier than wall time while others load the machine); the same
outside prefill (what attending a longer cache costs a forward: the most a prefix cache can
give back); each over the short-prefix row of the same decoder, batch and cache; the share of
the row's wall time spent computing prompts (`RequestStats.prefill_seconds`: forwards that
only compute prompts, and the prompt tokens' share of the others) overall and per request
(the mean of prefill over its own wall time); the prompt positions computed and reused (from
the cache, or computed once for requests admitted together); generated tokens per second;
the budgets `auto` ran at; whether the tokens equal the first row's for those prompts.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.continuous_batching import (  # noqa: E402
    budgets_used,
    generated_tokens,
    spot_auto,
    take_turns,
    target_arguments,
)
from pipeline.drafter_data import corpus_prompts, load_model_and_tokenizer  # noqa: E402
from spot.config import DecodingConfig  # noqa: E402
from spot.decode import Request, Result, stream  # noqa: E402
from spot.drafting import Drafter  # noqa: E402
from spot.models.prefix_cache import PrefixCache  # noqa: E402
from spot.noise import request_key  # noqa: E402

SYSTEM_PROMPTS = {
    "short": "Be brief.",
    "long": (
        "You are a patient maths tutor who writes for a student. Read the question twice "
        "before you start. Write down what is known and what is asked. Work in small steps "
        "and show each one on its own line. Check every sum and every product before you go "
        "on. When a function is given, apply it to the number one step at a time. When a list "
        "is given, say what happens to each item in turn. Keep the words short and plain. Use "
        "the names the question uses, and never change a number it gives. Do not guess: if a "
        "step is unclear, say which one. Give the answer as a number on the last line, after "
        "four hash marks. Write numbers with digits, not words, and keep units next to them."
    ),
}


@dataclass
class Row:
    """One replica: a decoder, a batch size, a system prompt, with or without a cache."""

    decoder: str
    batch_size: int
    system: str  # a key of SYSTEM_PROMPTS
    cache: PrefixCache | None
    drafter: Drafter | None = None
    results: dict[int, Result] = field(default_factory=dict)
    seconds: float = 0.0
    cpu_seconds: float = 0.0

    def decode(
        self, target, requests: Mapping[str, Sequence[Request]], config
    ) -> Iterator[tuple[int, Result]]:
        yield from stream(
            target,
            requests[self.system],
            config,
            self.drafter,
            max_active=self.batch_size,
            prefix_cache=self.cache,
        )

    @property
    def setting(self) -> tuple[str, int, bool]:
        return self.decoder, self.batch_size, self.cache is not None

    def outputs(self) -> list[list[int]]:
        return [self.results[i].tokens.tolist() for i in sorted(self.results)]


def system_requests(tokenizer, prompts: Sequence[dict], system: str) -> list[Request]:
    """Chat-template prompts with `system` as their first turn, noise keys from the ids."""
    out = []
    for p in prompts:
        turns = [{"role": "system", "content": system}, {"role": "user", "content": p["prompt"]}]
        text = tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=False)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        out.append(Request(torch.tensor(ids), request_key(p["id"])))
    return out


@dataclass(frozen=True)
class Measured:
    forwards: float
    rate: float  # forwards per second, prefill included
    decode_rate: float  # forwards per second outside prefill
    prefill_share: float  # of the row's wall time
    request_prefill_share: float  # mean over requests of prefill / its own wall time
    computed: int
    reused: int
    tokens_per_second: float


def measure(row: Row, eos_ids: Sequence[int], cpu_time: bool) -> Measured:
    """The row's figures; rates per second of this process's CPU time in the row's turns
    when `cpu_time` (steadier than wall time while others load the machine; the prefill's
    share of it taken as its share of the row's wall time), else of wall time."""
    seconds = row.cpu_seconds if cpu_time else row.seconds
    stats = [r.stats for r in row.results.values()]
    forwards = sum(s.forward_share for s in stats)
    prefill = sum(s.prefill_seconds for s in stats) / row.seconds
    tokens = sum(generated_tokens(r, eos_ids) for r in row.results.values())
    return Measured(
        forwards,
        forwards / seconds,
        forwards / (seconds * (1 - prefill)),
        prefill,
        statistics.mean(s.prefill_seconds / s.wall_seconds for s in stats),
        sum(s.prompt_tokens_computed for s in stats),
        sum(s.prompt_tokens_reused for s in stats),
        tokens / seconds,
    )


def table(
    rows: list[Row], eos_ids: Sequence[int], lengths: Mapping[str, str], cpu_time: bool, heading
) -> str:
    second = "CPU s" if cpu_time else "s"
    lines = [
        heading,
        "",
        f"| batch | decoder | system prompt | prefix cache | forwards | forwards per {second} "
        "| long / short | outside prefill | long / short | prefill share | per request "
        f"| prompt tokens computed | reused | tokens per {second} | budget auto used | exact |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    measured = {id(r): measure(r, eos_ids, cpu_time) for r in rows}
    by_setting = {(r.system, r.setting): measured[id(r)] for r in rows}
    reference = {}
    for r in rows:
        reference.setdefault(r.system, r.outputs())
    for r in rows:
        m = measured[id(r)]
        short = by_setting["short", r.setting]
        lines.append(
            f"| {r.batch_size} | {r.decoder} | {r.system} ({lengths[r.system]}) "
            f"| {'on' if r.cache is not None else 'off'} | {m.forwards:.0f} | {m.rate:.1f} "
            f"| {m.rate / short.rate:.2f} | {m.decode_rate:.1f} "
            f"| {m.decode_rate / short.decode_rate:.2f} | {m.prefill_share:.1%} "
            f"| {m.request_prefill_share:.1%} | {m.computed} | {m.reused} "
            f"| {m.tokens_per_second:.1f} | {budgets_used(r.drafter)} "
            f"| {'yes' if r.outputs() == reference[r.system] else 'NO'} |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    target_arguments(p, prompts=48, batch_sizes=[1, 8])
    p.add_argument("--cache-mib", type=float, default=64.0, help="the prefix cache's budget")
    args = p.parse_args()
    torch.set_grad_enabled(False)

    tokenizer, target = load_model_and_tokenizer(f"builtin:{args.target}", args.dtype, args.device)
    prompts = corpus_prompts("heldout", args.prompts)
    requests = {
        name: system_requests(tokenizer, prompts, text) for name, text in SYSTEM_PROMPTS.items()
    }
    lengths = {
        name: f"{len(tokenizer(text, add_special_tokens=False)['input_ids'])} tokens"
        for name, text in SYSTEM_PROMPTS.items()
    }
    config = DecodingConfig(gen_length=args.gen_length, block_length=args.block_length)
    auto = spot_auto(target, args.target, args.block_length, args.batch_sizes)
    budget = int(args.cache_mib * 2**20)
    rows = []
    for b in args.batch_sizes:
        for decoder in ("draft-free", "SPOT auto"):
            for system in SYSTEM_PROMPTS:
                for cached in (False, True):
                    cache = PrefixCache(budget, args.block_length) if cached else None
                    drafter = auto() if decoder == "SPOT auto" else None
                    rows.append(Row(decoder, b, system, cache, drafter))
    take_turns(rows, target, requests, config)
    prompt_lengths = [r.prompt.numel() for r in requests["long"]]
    heading = (
        f"### {args.target} ({args.dtype}, {target.device}) — block {config.block_length}, gen "
        f"{config.gen_length}, T={config.temperature}, {args.prompts} held-out prompts "
        f"(behind the long system prompt {min(prompt_lengths)}-{max(prompt_lengths)} tokens), "
        f"prefix cache {args.cache_mib:g} MiB, {torch.get_num_threads()} thread(s)"
    )
    cpu_time = target.device.type == "cpu"
    print(table(rows, target.eos_ids, lengths, cpu_time, heading))


if __name__ == "__main__":
    main()
