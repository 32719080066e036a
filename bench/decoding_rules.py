"""Commit rules and drafters against answer accuracy and tokens/s, on the bundled targets.

    OMP_NUM_THREADS=1 .venv/bin/python bench/decoding_rules.py --batch-sizes 8

Each variant is the quick-start job `jobs/synthetic.yaml` with the target, the commit rule
and the drafter overridden (`drafter.budget: auto`, as the job has it) and decoded by that
job's own replica, `pipeline.engine.Engine` (tokenize, generate, detokenize; the chat
template, continuous batching at the job's batch size, budget auto measuring this machine's
forward cost when the engine is built). Per target the variants are: the static rule (one
token per step), threshold decoding at τ 0.9 and 0.7, and for SDAR targets `sdar_dynamic`
(τ 0.9, at 1 and 2 tokens per step); each draft-free and with every drafter kind the
registry (`spot.drafters.registry.DRAFTERS`) says serves the rule and that is bundled for it.

Prompts: the first --prompts held-out *maths* problems of spot/builtin/prompts/heldout.jsonl,
the set docs/benchmarks.md §1 scores (`spot_common.corpus.heldout_prompts`); past
its 314, the corpus's own held-out set continues it (`spot_common.corpus.heldout_prompt_set`,
whose first 400 examples the file holds: problems whose key training never used; the corpus
has 533 distinct held-out maths problems, --prompts 520 takes nearly all). A
completion is right when its final answer equals the row's `answer` column
(`spot_common.corpus.is_correct`, the scorer of `spot-factory evaluate-target`).

The variants take turns, one call of the job's engine at a time (--chunk rows: by default the
rows one replica call takes on a job of this size, `pipeline.estimate.block_rows`), the order
rotated every turn, --passes times over the prompts, so a slow spell of the shared machine
falls on every variant alike: read the tokens/s ratios against static draft-free decoding
(wall time, with the interquartile range of the per-turn ratios, and per second of this
process's CPU time, steadier while other work loads the machine); absolute tokens/s
(generated tokens, the output's `num_generated_tokens`) move with the machine's load. Not in
them: building each engine ("engine start", CPU seconds: loading the target and drafter, and
for budget auto timing this machine's forwards), which a replica pays once.
Accuracy (first pass) comes with a Wilson 95% interval and a paired comparison with static
draft-free decoding on the same prompts: how many completions differ at all, how many
answers the variant loses and gains, the exact two-sided McNemar p-value of those flips, and
the accuracy difference with its paired 95% interval. "well-formed": worked lines and a final
`#### n` line, right or wrong (`spot_common.corpus.is_well_formed`).
"exact" compares each drafted variant's tokens with the draft-free decoding of its own rule
(speculative decoding is lossless), and `sdar_dynamic` at one token per step with threshold
decoding at the same τ (the same commits but for a confidence exactly at τ).
"""

from __future__ import annotations

import argparse
import math
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.continuous_batching import budgets_used  # noqa: E402
from pipeline.engine import Engine  # noqa: E402
from pipeline.estimate import block_rows, sample_rows  # noqa: E402
from pipeline.job import Job, load_job  # noqa: E402
from spot.builtin import builtin_drafter  # noqa: E402
from spot.drafters.registry import DRAFTERS  # noqa: E402
from spot_common.corpus import (  # noqa: E402
    heldout_prompt_set,
    heldout_prompts,
    is_correct,
    is_well_formed,
    write_jsonl,
)

JOB = ROOT / "jobs" / "synthetic.yaml"
FAMILIES = {"sdar-tiny": "sdar", "sdar-nano": "sdar", "llada-tiny": "llada"}
HELDOUT_EXAMPLES = 1000  # held-out examples written when --prompts exceeds the bundled file's
DRAFTER_NAMES = {"none": "draft-free", "spot": "SPOT", "spiffy": "Spiffy", "spot-sets": "SPOT-Sets"}


@dataclass(frozen=True)
class Rule:
    """One commit-rule setting of the job's decoding section."""

    label: str
    rule: str
    threshold: float = 0.9
    tokens_per_step: int = 1
    same_as: str | None = None  # the label of a rule whose draft-free tokens these must equal

    def overrides(self) -> list[str]:
        return [
            f"decoding.rule={self.rule}",
            f"decoding.threshold={self.threshold}",
            f"decoding.tokens_per_step={self.tokens_per_step}",
        ]


STATIC = Rule("static", "static")
RULES = (
    STATIC,
    Rule("threshold 0.9", "threshold", 0.9),
    Rule("threshold 0.7", "threshold", 0.7),
)
SDAR_RULES = (
    Rule("sdar_dynamic 0.9", "sdar_dynamic", 0.9, same_as="threshold 0.9"),
    Rule("sdar_dynamic 0.9, 2/step", "sdar_dynamic", 0.9, tokens_per_step=2),
)


@dataclass
class Variant:
    """One (rule, drafter) job, its engine, and what it measured over its turns."""

    rule: Rule
    drafter: str  # a registry kind, or "none"
    job: Job
    engine: Engine | None = None
    passes: list[list[pa.Table]] = field(default_factory=list)  # [pass][chunk] output rows
    seconds: float = 0.0
    cpu_seconds: float = 0.0  # this process's CPU time in the variant's turns
    start_cpu_seconds: float = 0.0  # building the engine (budget auto measures forwards)
    chunk_rates: list[float] = field(default_factory=list)  # generated tokens/s per turn

    def start(self) -> None:
        """Build the job's engine, as a replica does at its start."""
        c0 = time.process_time()
        self.engine = Engine(self.job)
        self.start_cpu_seconds = time.process_time() - c0

    @property
    def table(self) -> pa.Table:
        """The output rows of the first pass over the prompts."""
        return pa.concat_tables(self.passes[0])

    def tokens(self) -> int:
        """Generated tokens over every pass (what its seconds were spent on)."""
        return sum(_tokens(out) for chunks in self.passes for out in chunks)

    def token_ids(self) -> list[list[int]]:
        return self.table.column("completion_token_ids").to_pylist()

    def repeatable(self) -> bool:
        """Every pass wrote the first pass's tokens."""
        ids = [pa.concat_tables(p).column("completion_token_ids") for p in self.passes]
        return all(other == ids[0] for other in ids[1:])

    def correct(self) -> list[bool]:
        """Whether each completion's final answer is the row's `answer`."""
        return [is_correct(item, text) for item, text in self._scored()]

    def well_formed(self) -> list[bool]:
        """Whether each completion has the shape of a worked solution (see `is_well_formed`)."""
        return [is_well_formed(item, text) for item, text in self._scored()]

    def _scored(self) -> list[tuple[dict, str]]:
        table = self.table
        rows = zip(
            table.column("kind").to_pylist(),
            table.column("answer").to_pylist(),
            table.column("completion").to_pylist(),
        )
        return [({"kind": k, "answer": a}, c or "") for k, a, c in rows]


def _tokens(out: pa.Table) -> int:
    return pc.sum(out.column("num_generated_tokens")).as_py() or 0


def serving_drafters(target: str, rule: Rule, block_length: int) -> list[str]:
    """The registry's kinds that draft for `rule` and are bundled for `target` at this block
    length and rule."""
    kinds = []
    for name, kind in DRAFTERS.items():
        if rule.rule not in kind.rules:
            continue
        try:
            builtin_drafter(target, name, block_length, rule.rule)
        except FileNotFoundError:
            continue
        kinds.append(name)
    return kinds


def make_variants(
    target: str, batch_size: int, base: list[str], drafters: bool = True
) -> list[Variant]:
    """The target's rule variants, each draft-free and (`drafters`) with every bundled drafter
    that serves its rule."""
    rules = RULES + (SDAR_RULES if FAMILIES[target] == "sdar" else ())
    variants = []
    for rule in rules:
        overrides = [
            *base,
            "input.limit=null",
            f"model.path=builtin:{target}",
            f"model.family={FAMILIES[target]}",
            f"resources.batch_size={batch_size}",
            *rule.overrides(),
        ]
        free = load_job(JOB, [*overrides, "drafter.kind=none"])
        variants.append(Variant(rule, "none", free))
        if rule.same_as or not drafters:
            continue
        for kind in serving_drafters(target, rule, free.decoding.block_length):
            drafter = [f"drafter.kind={kind}", "drafter.budget=auto"]
            variants.append(Variant(rule, kind, load_job(JOB, overrides + drafter)))
    return variants


def maths_rows(job: Job, count: int) -> pa.Table:
    """The first `count` maths problems of the job's input in the engine's input form (the
    job's own input plan, `pipeline.estimate.sample_rows`)."""
    rows, _ = sample_rows(job, 1 << 62)  # every row, in file order
    maths = rows.filter(pc.equal(rows.column("kind"), "math")).slice(0, count)
    if maths.num_rows < count:
        raise ValueError(f"the job's input holds {maths.num_rows} maths problems, not {count}")
    return maths


def heldout_input(count: int, folder: Path, examples: int = HELDOUT_EXAMPLES) -> str:
    """An input path whose first maths problems are the `count` held-out ones `heldout_prompts`
    gives §1 and past its 314 those of the corpus's own held-out set, written to `folder`: its
    first `examples` examples (the bundled file holds the first 400; 1000 hold 531 of the
    corpus's 533 held-out maths problems with distinct keys)."""
    if len(heldout_prompts(["math"], count)) == count:
        return "builtin:prompts/heldout.jsonl"
    path = folder / f"heldout-{examples}.jsonl"
    write_jsonl(path, heldout_prompt_set(0, examples))
    return str(path)


def take_turns(variants: list[Variant], rows: pa.Table, chunk: int, passes: int = 1) -> None:
    """Every variant's engine processes every chunk of `rows`, `passes` times over; chunk by
    chunk, the variants take turns in an order rotated each chunk."""
    starts = range(0, rows.num_rows, chunk)
    for number in range(passes * len(starts)):
        if number % len(starts) == 0:
            for variant in variants:
                variant.passes.append([])
        part = rows.slice(starts[number % len(starts)], chunk)
        shift = number % len(variants)
        for variant in variants[shift:] + variants[:shift]:
            t0, c0 = time.perf_counter(), time.process_time()
            out = variant.engine.process(part)
            seconds = time.perf_counter() - t0
            variant.seconds += seconds
            variant.cpu_seconds += time.process_time() - c0
            variant.passes[-1].append(out)
            variant.chunk_rates.append(_tokens(out) / seconds)


def wilson(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score 95% interval of a binomial proportion."""
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def mcnemar_p(lost: int, gained: int) -> float:
    """Exact two-sided McNemar p-value: the chance of flips at least this lopsided if a
    flipped answer were as likely to go either way."""
    n = lost + gained
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(min(lost, gained) + 1)) / 2**n
    return min(1.0, 2 * tail)


def paired_difference(lost: int, gained: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The accuracy difference (gained - lost) / n and the half-width of its paired 95%
    interval (normal approximation over the n prompts)."""
    diff = (gained - lost) / n
    variance = ((lost + gained) / n - diff * diff) / n
    return diff, z * math.sqrt(max(variance, 0.0))


def quartiles(values: list[float]) -> tuple[float, float]:
    """The 25th and 75th percentiles (both the value itself when there is one)."""
    if len(values) < 2:
        return values[0], values[0]
    q1, _, q3 = statistics.quantiles(values, n=4)
    return q1, q3


def report(variants: list[Variant], heading: str) -> str:
    base = variants[0]  # static, draft-free
    base_correct, base_ids = base.correct(), base.token_ids()
    base_rate = base.tokens() / base.seconds
    base_cpu_rate = base.tokens() / base.cpu_seconds
    by_rule = {(v.rule.label, v.drafter): v for v in variants}
    lines = [
        heading,
        "",
        "| rule | drafter | accuracy (95% CI) | well-formed | answers lost / gained vs static (p) "
        "| difference (95% CI) "
        "| completions ≠ static | NFE mean | steps/forward | tokens/row | tokens/s (noisy) "
        "| vs static draft-free (turns' IQR) | per CPU second | budget auto used "
        "| engine start, CPU s | exact |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for v in variants:
        correct, ids = v.correct(), v.token_ids()
        n, right = len(correct), sum(correct)
        low, high = wilson(right, n)
        lost = sum(b and not c for b, c in zip(base_correct, correct))
        gained = sum(c and not b for b, c in zip(base_correct, correct))
        diff, half = paired_difference(lost, gained, n)
        changed = sum(a != b for a, b in zip(base_ids, ids))
        table = v.table
        rate = v.tokens() / v.seconds
        q1, q3 = quartiles([r / b for r, b in zip(v.chunk_rates, base.chunk_rates)])
        cpu_ratio = v.tokens() / v.cpu_seconds / base_cpu_rate
        reference = by_rule[v.rule.same_as or v.rule.label, "none"]
        exact = "–" if reference is v else "yes" if ids == reference.token_ids() else "NO"
        if not v.repeatable():
            exact += " (passes differ)"
        nfe = pc.sum(table.column("nfe")).as_py()
        steps = pc.sum(table.column("steps")).as_py()
        lines.append(
            f"| {v.rule.label} | {DRAFTER_NAMES[v.drafter]} | {right / n:.1%} "
            f"({low:.1%}-{high:.1%}) | {sum(v.well_formed()) / n:.1%} "
            f"| {lost} / {gained} ({mcnemar_p(lost, gained):.2f}) "
            f"| {diff:+.1%} ± {half:.1%} "
            f"| {changed} | {nfe / n:.1f} | {steps / nfe:.2f} | {_tokens(table) / n:.1f} "
            f"| {rate:.0f} | {rate / base_rate:.2f}x ({q1:.2f}-{q3:.2f}) | {cpu_ratio:.2f}x "
            f"| {budgets_used(v.engine.drafter)} | {v.start_cpu_seconds:.1f} | {exact} |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--targets", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    p.add_argument(
        "--prompts",
        type=int,
        default=200,
        help="first N held-out maths problems (past the bundled file's 314: the corpus's)",
    )
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[8])
    p.add_argument("--chunk", type=int, default=None, help="rows per turn (default: the job's)")
    p.add_argument("--passes", type=int, default=1, help="times over the prompts (timing)")
    p.add_argument("--draft-free", action="store_true", help="no drafted variants")
    p.add_argument("--threads", type=int, default=1, help="torch threads (the job's num_cpus)")
    p.add_argument("--set", dest="overrides", action="append", default=[], help="job key=value")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)

    folder = Path(tempfile.mkdtemp(prefix="decoding-rules-"))
    inputs = [f"input.path={heldout_input(args.prompts, folder)}"]
    bundled = [p["id"] for p in heldout_prompts(["math"], args.prompts)]
    for target in args.targets:
        for batch_size in args.batch_sizes:
            variants = make_variants(
                target, batch_size, inputs + args.overrides, drafters=not args.draft_free
            )
            job = variants[0].job
            rows = maths_rows(job, args.prompts)
            if rows.column("id").to_pylist()[: len(bundled)] != bundled:
                raise RuntimeError("the input's first maths problems are not the bundled ones")
            chunk = args.chunk or block_rows(job, rows.num_rows)
            started = time.perf_counter()
            for v in variants:
                v.start()
            take_turns(variants, rows, chunk, args.passes)
            d = job.decoding
            heading = (
                f"### {target}, batch {batch_size}: {rows.num_rows} held-out maths prompts, "
                f"block {d.block_length}, gen {d.gen_length}, T={d.temperature}, "
                f"{args.threads} thread(s), {args.passes} pass(es) in turns of {chunk} rows, "
                f"{time.perf_counter() - started:.0f} s"
            )
            print(report(variants, heading), flush=True)
            print(flush=True)
    shutil.rmtree(folder)


if __name__ == "__main__":
    main()
