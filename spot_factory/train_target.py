"""Train the bundled diffusion targets on the corpus, on CPU, and save them in their family's
original checkpoint format. The family (`spot.models.registry`) says what differs: its native
traits (`fresh_config`), its EOS order, and by its attention which objective it learns.

Block-causal families (SDAR; block diffusion): each training row is the clean sequence followed
by `noised_copies` noised copies of its blocks from the one holding the end of the prompt.
Every block of a noised copy gets its own mask ratio t ~ U(0, 1]; answer positions are masked
with probability t (prompt positions stay clean). A noised block attends bidirectionally to
itself and to the *clean* previous blocks, exactly what it sees at decoding time over an exact
KV cache; clean blocks attend block-causally. Batches alternate block lengths 16 and 32.

Bidirectional families (LLaDA): the prompt is clean and the answer region (answer, then EOS up
to `gen_length`) is masked either with one ratio t ~ U(0, 1] (LLaDA's SFT objective) or, half
of the time, semi-autoregressively as the block decoder sees it: earlier blocks clean, one block
at ratio t, later blocks fully masked.

Loss: cross-entropy on masked positions, averaged over them. AdamW, linear warm-up then
cosine decay, gradient clipping; a tqdm bar and one JSON line per step in the loss log.
"""

from __future__ import annotations

import json
import math
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import click
import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, field_validator
from tokenizers import Tokenizer
from tqdm import tqdm

from spot.builtin import builtin_root, resolve_builtin
from spot.models.loading import save_checkpoint as save_checkpoint_files
from spot.models.registry import Family, families, family_for
from spot.models.transformer import Transformer, TransformerConfig
from spot_common.corpus import examples
from spot_factory.cli import chosen_output, output_options
from spot_factory.tokenizer import EOS, IM_END, MASK, chat_prompt


class Architecture(BaseModel):
    """Native transformer shape (GQA, SwiGLU; QK-norm follows the family)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    hidden_size: int = Field(gt=0)
    intermediate_size: int = Field(gt=0)
    num_layers: int = Field(gt=0)
    num_heads: int = Field(gt=0)
    num_kv_heads: int = Field(gt=0)
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = Field(
        True, description="one matrix embeds tokens and scores them (copying is then cheap)"
    )


class TrainSpec(BaseModel):
    """Everything that determines a trained target (with the corpus seed and tokenizer)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    family: str = Field(description="a registered family that trains from scratch")
    architecture: Architecture
    block_lengths: tuple[int, ...] = Field(
        (16, 32), description="block lengths the target learns; batches cycle through them"
    )
    noised_copies: int = Field(
        2, ge=1, description="block-causal families: noised copies per clean sequence"
    )
    gen_length: int = Field(
        64, gt=0, description="bidirectional families: answer region, answer + EOS fill"
    )
    steps: int = Field(gt=0)
    batch_size: int = Field(gt=0)
    learning_rate: float = 2e-3
    min_learning_rate_ratio: float = 0.1
    warmup_steps: int = 50
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    corpus_seed: int = 0
    save_dtype: Literal["bfloat16", "float32"] = "bfloat16"
    max_position_embeddings: int = 512

    @field_validator("family")
    @classmethod
    def _trainable(cls, name: str) -> str:
        trainable = sorted(n for n, f in families().items() if f.fresh_traits is not None)
        if name not in trainable:
            raise ValueError(f"family {name!r} is not trained here; trainable: {trainable}")
        return name

    @property
    def target_family(self) -> Family:
        return family_for(self.family)


PRESETS: dict[str, TrainSpec] = {
    "sdar-tiny": TrainSpec(
        name="sdar-tiny",
        family="sdar",
        architecture=Architecture(
            hidden_size=192, intermediate_size=512, num_layers=5, num_heads=4, num_kv_heads=2
        ),
        steps=6000,
        batch_size=32,
    ),
    "sdar-nano": TrainSpec(
        name="sdar-nano",
        family="sdar",
        architecture=Architecture(
            hidden_size=128, intermediate_size=384, num_layers=4, num_heads=4, num_kv_heads=2
        ),
        steps=2500,
        batch_size=32,
    ),
    "llada-tiny": TrainSpec(
        name="llada-tiny",
        family="llada",
        architecture=Architecture(
            hidden_size=192, intermediate_size=512, num_layers=5, num_heads=4, num_kv_heads=2
        ),
        steps=2500,
        batch_size=32,
    ),
}


@dataclass(frozen=True)
class Batch:
    """One training batch in the native model's explicit-mask form."""

    input_ids: torch.Tensor  # [N, T] long
    position_ids: torch.Tensor  # [N, T] long
    attention_mask: torch.Tensor  # [N | 1, 1, T, T] bool, True = attend
    logits_at: torch.Tensor  # [N, S] long, positions of T whose logits the loss reads
    targets: torch.Tensor  # [N, S] long, the clean token there, -100 where no loss


@dataclass(frozen=True)
class SpecialIds:
    mask: int
    eos: int
    im_end: int


def _answer_and_fill(answer: list[int], end: int, start: int, eos: int) -> list[int]:
    return answer + [eos] * (end - start - len(answer))


def _sdar_row(
    prompt: list[int],
    answer: list[int],
    b: int,
    copies: int,
    ids: SpecialIds,
    generator: torch.Generator,
) -> tuple[torch.Tensor, ...]:
    """One row: tokens [T], positions [T], mask [T, T], noised slots [S], targets [S]."""
    end = -(-(len(prompt) + len(answer)) // b) * b  # end of the block holding the answer's end
    clean = torch.tensor(prompt + _answer_and_fill(answer, end, len(prompt), ids.eos))  # [end]
    start = len(prompt) // b * b  # first block with answer positions
    span = end - start
    t = 1.0 - torch.rand(copies, span // b, generator=generator)  # a ratio in (0, 1] per block
    t = t.repeat_interleave(b, dim=-1)  # [C, span]
    is_answer = torch.arange(start, end) >= len(prompt)  # [span]
    masked = (torch.rand(copies, span, generator=generator) < t) & is_answer  # [C, span]
    noised = torch.where(masked, ids.mask, clean[start:])  # [C, span]
    context = end - b  # the last clean block is never attended
    tokens = torch.cat([clean[:context], noised.flatten()])
    positions = torch.cat([torch.arange(context), torch.arange(start, end).repeat(copies)])
    copy = torch.cat([torch.full((context,), -1), torch.arange(copies).repeat_interleave(span)])
    block = positions // b
    q_clean, k_clean = (copy < 0)[:, None], (copy < 0)[None, :]
    earlier, same = block[None, :] < block[:, None], block[None, :] == block[:, None]
    mask = (
        (q_clean & k_clean & (earlier | same))  # clean: block-causal
        | (~q_clean & k_clean & earlier)  # noised: the clean blocks before it
        | (~q_clean & (copy[:, None] == copy[None, :]) & same)  # and its own block
    )
    slots = torch.arange(context, tokens.numel())
    targets = clean[start:].repeat(copies).masked_fill(~masked.flatten(), -100)
    return tokens, positions, mask, slots, targets


def sdar_batch(
    rows: list[tuple[list[int], list[int]]],
    block_length: int,
    noised_copies: int,
    ids: SpecialIds,
    generator: torch.Generator,
) -> Batch:
    """Block-diffusion batch over rows of (prompt ids, answer ids ending in <|im_end|>).

    A row's sequence is prompt, answer, then EOS to the end of the block holding the answer's
    end (where SDAR decoding stops). Its input is the clean sequence without its last block,
    then `noised_copies` noised copies of the blocks from the one holding the prompt's end;
    positions are the absolute ones of the clean sequence. Rows are padded with EOS that
    nothing attends; padded loss slots have target -100.
    """
    built = [_sdar_row(p, a, block_length, noised_copies, ids, generator) for p, a in rows]
    width = max(r[0].numel() for r in built)
    slots_width = max(r[3].numel() for r in built)
    n = len(rows)
    input_ids = torch.full((n, width), ids.eos, dtype=torch.long)
    position_ids = torch.zeros(n, width, dtype=torch.long)
    mask = torch.zeros(n, 1, width, width, dtype=torch.bool)
    logits_at = torch.full((n, slots_width), width - 1, dtype=torch.long)
    targets = torch.full((n, slots_width), -100, dtype=torch.long)
    for i, (tokens, positions, row_mask, slots, row_targets) in enumerate(built):
        length = tokens.numel()
        input_ids[i, :length] = tokens
        position_ids[i, :length] = positions
        position_ids[i, length:] = positions[-1]
        mask[i, 0, :length, :length] = row_mask
        mask[i, 0, length:, :length] = True  # padding queries attend something; no loss
        logits_at[i, : slots.numel()] = slots
        targets[i, : slots.numel()] = row_targets
    return Batch(input_ids, position_ids, mask, logits_at, targets)


def llada_batch(
    rows: list[tuple[list[int], list[int]]],
    gen_length: int,
    block_lengths: tuple[int, ...],
    ids: SpecialIds,
    generator: torch.Generator,
) -> Batch:
    """Bidirectional masked-diffusion batch: prompt clean, answer region [P, P + gen_length)
    masked at one ratio (half the rows) or semi-autoregressively (the other half)."""
    n = len(rows)
    length = max(len(p) for p, _ in rows) + gen_length
    tokens = torch.full((n, length), ids.eos, dtype=torch.long)
    valid = torch.zeros(n, length, dtype=torch.bool)
    region = torch.zeros(n, gen_length, dtype=torch.long)  # absolute index of region slots
    for i, (prompt, ans) in enumerate(rows):
        if len(ans) > gen_length:
            raise ValueError(f"answer of {len(ans)} tokens exceeds gen_length {gen_length}")
        seq = prompt + _answer_and_fill(ans, gen_length, 0, ids.eos)
        tokens[i, : len(seq)] = torch.tensor(seq)
        valid[i, : len(seq)] = True
        region[i] = torch.arange(len(prompt), len(prompt) + gen_length)
    t = 1.0 - torch.rand(n, 1, generator=generator)  # [N, 1]
    ratio = t.expand(n, gen_length).clone()  # [N, G] mask probability per region slot
    semi = torch.rand(n, generator=generator) < 0.5
    choice = torch.randint(len(block_lengths), (n,), generator=generator)
    for i in torch.nonzero(semi).flatten().tolist():
        b = block_lengths[int(choice[i])]
        current = int(torch.randint(gen_length // b, (1,), generator=generator))
        ratio[i, : current * b] = 0.0
        ratio[i, (current + 1) * b :] = 1.0
    masked = torch.rand(n, gen_length, generator=generator) < ratio  # [N, G]
    region_tokens = tokens.gather(1, region)
    noised = tokens.scatter(1, region, torch.where(masked, ids.mask, region_tokens))
    mask = (valid[:, None, :].expand(n, length, length))[:, None]  # [N, 1, T, T]
    return Batch(
        input_ids=noised,
        position_ids=torch.arange(length).expand(n, -1),
        attention_mask=mask,
        logits_at=region,
        targets=region_tokens.masked_fill(~masked, -100),
    )


def loss_of(model: Transformer, batch: Batch) -> tuple[torch.Tensor, int]:
    """Mean cross-entropy over masked positions, and how many there were."""
    logits, _, _ = model(
        batch.input_ids, batch.position_ids, batch.attention_mask, logits_at=batch.logits_at
    )
    count = int((batch.targets != -100).sum())
    loss = F.cross_entropy(
        logits.flatten(0, 1).float(), batch.targets.flatten(), ignore_index=-100, reduction="sum"
    )
    return loss / max(count, 1), count


class _Rows:
    """Tokenized training rows (prompt ids, answer ids + <|im_end|>) from the corpus, batched
    by length: `pool` batches' worth of rows are sorted by length and cut into batches, which
    are served in a seeded random order (less padding per batch)."""

    def __init__(
        self, tokenizer: Tokenizer, corpus_seed: int, max_answer: int, seed: int, pool: int = 8
    ):
        self.tokenizer = tokenizer
        self.stream = examples(corpus_seed, "train")
        self.max_answer = max_answer
        self.order = random.Random(seed)
        self.pool = pool
        self.ready: list[list[tuple[list[int], list[int]]]] = []
        self.seen = 0

    def _row(self) -> tuple[list[int], list[int]]:
        while True:
            item = next(self.stream)
            self.seen += 1
            prompt = self.tokenizer.encode(chat_prompt(item.prompt)).ids
            answer = self.tokenizer.encode(item.completion + IM_END).ids
            if len(answer) <= self.max_answer:
                return prompt, answer

    def take(self, count: int) -> list[tuple[list[int], list[int]]]:
        if not self.ready:
            rows = sorted(
                (self._row() for _ in range(count * self.pool)), key=lambda r: len(r[0]) + len(r[1])
            )
            self.ready = [rows[k : k + count] for k in range(0, len(rows), count)]
            self.order.shuffle(self.ready)
        return self.ready.pop()


def native_config(spec: TrainSpec, vocab_size: int) -> TransformerConfig:
    arch = spec.architecture
    return spec.target_family.fresh_config(
        vocab_size=vocab_size,
        hidden_size=arch.hidden_size,
        intermediate_size=arch.intermediate_size,
        num_layers=arch.num_layers,
        num_heads=arch.num_heads,
        num_kv_heads=arch.num_kv_heads,
        head_dim=arch.hidden_size // arch.num_heads,
        rope_theta=arch.rope_theta,
        tie_word_embeddings=arch.tie_word_embeddings,
        max_position_embeddings=spec.max_position_embeddings,
    )


def init_model(config: TransformerConfig, family: str, generator: torch.Generator) -> Transformer:
    """A fresh model, weights N(0, 0.02) (output projections scaled by depth), norms 1."""
    model = family_for(family).build(config)
    depth_scale = 1.0 / math.sqrt(2 * config.num_layers)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                param.normal_(0.0, 0.02 * depth_scale, generator=generator)
            else:
                param.normal_(0.0, 0.02, generator=generator)
    return model


def _schedule(spec: TrainSpec, step: int) -> float:
    if step < spec.warmup_steps:
        return (step + 1) / spec.warmup_steps
    progress = (step - spec.warmup_steps) / max(1, spec.steps - spec.warmup_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return spec.min_learning_rate_ratio + (1.0 - spec.min_learning_rate_ratio) * cosine


def _optimizer(model: Transformer, spec: TrainSpec) -> torch.optim.AdamW:
    decay = [p for n, p in model.named_parameters() if p.ndim == 2 and "embed" not in n]
    other = [p for n, p in model.named_parameters() if not (p.ndim == 2 and "embed" not in n)]
    groups = [
        {"params": decay, "weight_decay": spec.weight_decay},
        {"params": other, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=spec.learning_rate, betas=(0.9, 0.95))


def special_ids(tokenizer: Tokenizer) -> SpecialIds:
    return SpecialIds(
        mask=tokenizer.token_to_id(MASK),
        eos=tokenizer.token_to_id(EOS),
        im_end=tokenizer.token_to_id(IM_END),
    )


def train(
    spec: TrainSpec,
    output: Path,
    tokenizer_dir: Path | None = None,
    log_path: Path | None = None,
    threads: int | None = None,
    progress: bool = True,
) -> Path:
    """Train `spec` and save the checkpoint directory `output`; returns it."""
    if threads is not None:
        torch.set_num_threads(threads)
    tokenizer_dir = tokenizer_dir or resolve_builtin("tokenizer")
    tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    ids = special_ids(tokenizer)
    generator = torch.Generator().manual_seed(spec.seed)
    config = native_config(spec, tokenizer.get_vocab_size())
    model = init_model(config, spec.family, generator)
    optimizer = _optimizer(model, spec)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: _schedule(spec, s))
    rows = _Rows(tokenizer, spec.corpus_seed, spec.gen_length, spec.seed)
    output.mkdir(parents=True, exist_ok=True)
    log_path = log_path or output / "loss_log.jsonl"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    model.train()
    with log_path.open("w") as log, tqdm(total=spec.steps, disable=not progress) as bar:
        for step in range(spec.steps):
            block = spec.block_lengths[step % len(spec.block_lengths)]
            batch_rows = rows.take(spec.batch_size)
            if spec.target_family.block_causal:
                batch = sdar_batch(batch_rows, block, spec.noised_copies, ids, generator)
            else:
                batch = llada_batch(batch_rows, spec.gen_length, spec.block_lengths, ids, generator)
            loss, count = loss_of(model, batch)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), spec.grad_clip)
            optimizer.step()
            scheduler.step()
            record = {
                "step": step + 1,
                "loss": round(loss.item(), 5),
                "lr": scheduler.get_last_lr()[0],
                "grad_norm": round(float(grad_norm), 4),
                "block_length": block,
                "masked_tokens": count,
                "seconds": round(time.perf_counter() - started, 2),
            }
            log.write(json.dumps(record) + "\n")
            log.flush()
            bar.set_postfix(loss=f"{record['loss']:.4f}", block=block)
            bar.update(1)
    elapsed = time.perf_counter() - started
    save_checkpoint(model, spec, output, tokenizer_dir, ids, elapsed, rows.seen)
    return output


def save_checkpoint(
    model: Transformer,
    spec: TrainSpec,
    output: Path,
    tokenizer_dir: Path,
    ids: SpecialIds,
    seconds: float,
    examples_seen: int,
) -> None:
    """The family's original layout: config.json, generation_config.json,
    model.safetensors, the tokenizer files, plus training.json and README.md."""
    family = spec.target_family
    eos_ids = family.chat_eos_ids(ids.eos, ids.im_end)
    parameters = sum(p.numel() for p in model.parameters())
    stored = model.to(getattr(torch, spec.save_dtype))
    save_checkpoint_files(output, family, stored, ids.mask, eos_ids)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copyfile(tokenizer_dir / name, output / name)
    meta = {
        "spec": spec.model_dump(mode="json"),
        "parameters": parameters,
        "train_seconds": round(seconds, 1),
        "examples_seen": examples_seen,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }
    (output / "training.json").write_text(json.dumps(meta, indent=2) + "\n")
    (output / "README.md").write_text(_readme(spec, parameters, seconds, examples_seen))


def _readme(spec: TrainSpec, parameters: int, seconds: float, seen: int) -> str:
    arch = spec.architecture
    regime = (
        "block diffusion (block-causal, exact KV cache of committed blocks), trained for "
        f"block lengths {', '.join(map(str, spec.block_lengths))}"
        if spec.target_family.block_causal
        else f"bidirectional masked diffusion over a {spec.gen_length}-token answer region"
    )
    return (
        f"# {spec.name}\n\n"
        f"A small {spec.family.upper()}-family diffusion LM bundled with spot-pipeline: "
        f"{regime}.\n"
        f"{parameters / 1e6:.2f}M parameters: hidden {arch.hidden_size}, "
        f"{arch.num_layers} layers, {arch.num_heads} heads ({arch.num_kv_heads} KV heads), "
        f"MLP {arch.intermediate_size}; weights stored in {spec.save_dtype}.\n\n"
        f"Trained on the project's synthetic corpus (seed {spec.corpus_seed}, train split: "
        f"grade-school maths word problems with worked solutions, function traces, small "
        f"Python functions, JSON records) for {spec.steps} steps of {spec.batch_size} "
        f"sequences ({seen} examples) in {seconds / 60:.1f} min on CPU; AdamW "
        f"(lr {spec.learning_rate}, cosine), seed {spec.seed}.\n\n"
        f"Reproduce: `spot-factory train-target {spec.name} --into-package`; the exact "
        "settings are in training.json. Prompts use the chat template in "
        "tokenizer_config.json.\n"
    )


@click.command("train-target")
@click.argument("name", type=click.Choice(sorted(PRESETS)))
@output_options
@click.option(
    "--tokenizer",
    "tokenizer_dir",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    default=None,
    help="tokenizer directory (from build-corpus; default: the bundled tokenizer)",
)
@click.option("--steps", type=int, default=None, help="override the preset's step count")
@click.option("--batch-size", type=int, default=None, help="override the preset's batch size")
@click.option("--log", "log_path", type=click.Path(path_type=Path), default=None)
@click.option("--threads", type=int, default=None, help="torch CPU threads")
def train_target_command(
    name: str,
    output: Path | None,
    into_package: bool,
    tokenizer_dir: Path | None,
    steps: int | None,
    batch_size: int | None,
    log_path: Path | None,
    threads: int | None,
) -> None:
    """Train a bundled target (sdar-tiny, sdar-nano, llada-tiny) on CPU into the checkpoint
    directory OUTPUT (with --into-package: spot/builtin/targets/NAME)."""
    output = chosen_output(output, into_package, builtin_root() / "targets" / name)
    overrides = {k: v for k, v in (("steps", steps), ("batch_size", batch_size)) if v}
    spec = PRESETS[name].model_copy(update=overrides)
    path = train(spec, output, tokenizer_dir, log_path=log_path, threads=threads)
    click.echo(f"saved {spec.name} to {path}")
