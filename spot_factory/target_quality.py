"""Quality of a target under its own draft-free decoding, on the bundled held-out prompts.

Static decoding, one token per step, T=0, through `spot.decode.generate`. Per block length:
- accuracy: the final answer (maths, traces) or the whole completion (code, records) is right;
- well-formed: the completion has the expected shape (see `corpus.is_well_formed`);
- left-most: fraction of steps whose committed position is the left-most masked one of the
  block (1.0 would be autoregressive order);
- stale-token accuracy: fraction of steps, after a block's first, where the argmax of the
  previous step's distribution at the committed position equals the committed token.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import click
import torch

from spot.builtin import resolve_builtin
from spot.config import DecodingConfig
from spot.decode import Request, generate
from spot.models.loading import load_target
from spot.noise import request_key
from spot.target import Target
from spot.tree import State
from spot_common.corpus import heldout_prompts, is_correct, is_well_formed
from spot_common.tokenizer import load_tokenizer
from spot_factory.tokenizer import chat_prompt


@dataclass
class TrajectoryStats:
    """Commit-order statistics gathered through the decode loop's trace hook."""

    block_length: int
    mask_id: int
    steps: int = 0
    leftmost: int = 0
    stale_steps: int = 0
    stale_hits: int = 0
    _previous: dict[int, tuple[int, torch.Tensor]] = field(default_factory=dict)

    def __call__(
        self,
        index: int,
        state: State,
        logits: torch.Tensor,
        successor: State,
        hidden: torch.Tensor | None = None,
    ) -> None:
        b = self.block_length
        start = state.block_start(b)
        block = state.block(b)
        width = state.span.numel()
        after = successor.span[width - b : width]  # same positions, one step later
        masked = block == self.mask_id
        committed = masked & (after != block)
        positions = torch.nonzero(committed).flatten()
        if positions.numel():
            self.steps += 1
            first_masked = int(torch.nonzero(masked).flatten()[0])
            self.leftmost += int(positions[0]) == first_masked
            previous = self._previous.get(index)
            if previous is not None and previous[0] == start:
                stale = previous[1].argmax(dim=-1)  # [B]
                self.stale_steps += positions.numel()
                self.stale_hits += int((stale[positions] == after[positions]).sum())
        self._previous[index] = (start, logits.detach().float())


@dataclass(frozen=True)
class QualityRow:
    target: str
    block_length: int
    problems: int
    accuracy: float
    well_formed: float
    leftmost: float
    stale_token_accuracy: float
    mean_tokens: float
    seconds: float


def completion_text(tokenizer, tokens: torch.Tensor, eos_ids: Sequence[int]) -> tuple[str, int]:
    """Text before the first EOS, and its token count."""
    ids = tokens.tolist()
    end = next((i for i, t in enumerate(ids) if t in eos_ids), len(ids))
    return tokenizer.decode(ids[:end], skip_special_tokens=False), end


def evaluate(
    name: str,
    target: Target,
    tokenizer,
    prompts: list[dict],
    block_length: int,
    gen_length: int = 64,
    batch_size: int = 50,
) -> tuple[QualityRow, list[str]]:
    """Decode every prompt draft-free and score the completions."""
    config = DecodingConfig(
        gen_length=gen_length, block_length=block_length, rule="static", tokens_per_step=1
    )
    stats = TrajectoryStats(block_length, target.mask_id)
    completions: list[str] = []
    lengths: list[int] = []
    started = time.perf_counter()
    for chunk_start in range(0, len(prompts), batch_size):
        chunk = prompts[chunk_start : chunk_start + batch_size]
        requests = [
            Request(
                torch.tensor(tokenizer.encode(chat_prompt(p["prompt"]), add_special_tokens=False)),
                request_key(p["id"]),
            )
            for p in chunk
        ]

        def trace(index, state, logits, successor, hidden, offset=chunk_start):
            stats(offset + index, state, logits, successor)

        for result in generate(target, requests, config, trace=trace):
            text, count = completion_text(tokenizer, result.tokens, target.eos_ids)
            completions.append(text)
            lengths.append(count)
    seconds = time.perf_counter() - started
    n = len(prompts)
    row = QualityRow(
        target=name,
        block_length=block_length,
        problems=n,
        accuracy=sum(is_correct(p, c) for p, c in zip(prompts, completions)) / n,
        well_formed=sum(is_well_formed(p, c) for p, c in zip(prompts, completions)) / n,
        leftmost=stats.leftmost / max(stats.steps, 1),
        stale_token_accuracy=stats.stale_hits / max(stats.stale_steps, 1),
        mean_tokens=sum(lengths) / n,
        seconds=seconds,
    )
    return row, completions


def markdown_table(rows: Sequence[QualityRow]) -> str:
    lines = [
        "| target | block | problems | accuracy | well-formed | left-most commit | "
        "stale-token acc. | tokens | seconds |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.target} | {r.block_length} | {r.problems} | {r.accuracy:.1%} | "
            f"{r.well_formed:.1%} | {r.leftmost:.1%} | {r.stale_token_accuracy:.1%} | "
            f"{r.mean_tokens:.1f} | {r.seconds:.0f} |"
        )
    return "\n".join(lines)


@click.command("evaluate-target")
@click.argument("targets", nargs=-1)
@click.option("--count", type=int, default=200, show_default=True, help="held-out problems")
@click.option(
    "--kinds", default="math", show_default=True, help="comma-separated: math,trace,code,record"
)
@click.option("--block-lengths", default="32,16", show_default=True)
@click.option("--gen-length", type=int, default=64, show_default=True)
@click.option("--threads", type=int, default=None, help="torch CPU threads")
@click.option("--show", type=int, default=0, help="print this many completions per run")
def evaluate_target_command(
    targets: tuple[str, ...],
    count: int,
    kinds: str,
    block_lengths: str,
    gen_length: int,
    threads: int | None,
    show: int,
) -> None:
    """Draft-free quality of TARGETS (checkpoint dirs or builtin:<name>; default: all three
    bundled targets) on the held-out prompts: accuracy, well-formedness, commit order."""
    if threads is not None:
        torch.set_num_threads(threads)
    targets = targets or ("builtin:sdar-tiny", "builtin:sdar-nano", "builtin:llada-tiny")
    prompts = heldout_prompts(kinds.split(","), count)
    rows = []
    for reference in targets:
        path = resolve_builtin(reference) if reference.startswith("builtin:") else Path(reference)
        target = load_target(path, dtype=torch.float32)
        tokenizer = load_tokenizer(path)
        for block in (int(b) for b in block_lengths.split(",")):
            row, completions = evaluate(
                path.name, target, tokenizer, prompts, block, gen_length=gen_length
            )
            rows.append(row)
            click.echo(markdown_table([row]).splitlines()[-1])
            for p, c in list(zip(prompts, completions))[:show]:
                click.echo(f"--- {p['id']} expected {p['answer']!r}\n{c}")
    click.echo(markdown_table(rows))
