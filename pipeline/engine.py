"""The engine one replica holds: tokenizer, target and drafter, built once; it turns a batch
of input rows into output rows.

Every row comes back: a row that cannot be generated (no id, duplicate id, null / empty /
non-string prompt, prompt too long for the target, a failure inside generation) becomes a row
with `error` set and no completion, never a failed batch.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import pyarrow as pa
import torch

from pipeline.job import Job, resolve_model_path
from pipeline.prompts import PromptError, cut_at_stop, prompt_ids, prompt_text
from pipeline.schema import GENERATED_FIELDS, ID, MESSAGES, PROMPT, ROW_ERROR, SAMPLE_INDEX
from spot import noise
from spot.budget import AutoBudget
from spot.decode import Drafter, Request, Result, generate
from spot.target import Target
from spot.tree import Layout


def load_model(job: Job) -> tuple[Any, Target]:
    """The tokenizer and target of job.model (a hub id not yet cached is downloaded)."""
    from pipeline.tokenizer import load_tokenizer
    from spot.models.loading import DTYPES, load_target, resolve_checkpoint

    directory = resolve_checkpoint(resolve_model_path(job.model.path))
    device = "cuda" if job.resources.num_gpus > 0 else "cpu"  # Ray exposes the replica's GPU
    tokenizer = load_tokenizer(directory)
    if job.model.tensor_parallel > 1:
        target = _sharded_target(job, str(directory))
    else:
        target = load_target(
            directory, family=job.model.family, dtype=DTYPES[job.model.dtype], device=device
        )
    return tokenizer, target


def _sharded_target(job: Job, checkpoint: str) -> Target:
    """The target sharded over the job's `model.tensor_parallel` ranks, this process being
    rank 0: on GPUs when the replica has them, else on CPU with each rank taking an equal
    share of the replica's CPUs."""
    from spot.models.tensor_parallel import GroupSpec, ModelSpec, sharded_target

    degree = job.model.tensor_parallel
    device = "cuda" if job.resources.num_gpus > 0 else "cpu"
    threads = max(1, int(job.resources.num_cpus // degree))
    model = ModelSpec(checkpoint, job.model.family, job.model.dtype)
    return sharded_target(model, GroupSpec(degree, device, threads))


def build_drafter(job: Job, target: Target) -> Drafter | None:
    """The job's drafter (None: draft-free). With budget auto, the forward cost of this
    target on this machine is measured once here and the budget chosen per batch size."""
    path = job.drafter_path()
    if path is None:
        return None
    from spot.budget import AutoBudget, measure_forward_cost
    from spot.drafters.registry import acceptance_curve, load_drafter

    if job.drafter.budget != "auto":
        return load_drafter(job.drafter.kind, path, job.drafter.budget, target)
    curve = acceptance_curve(job.drafter.kind, path)
    largest = max(curve.budgets)
    batch = job.resources.batch_size
    block = job.decoding.block_length
    states = sorted({1, 2, 4, 8, 16, 32, batch, batch * (largest + 1)})
    cost = measure_forward_cost(target, block, 4 * block, states)
    return AutoBudget(load_drafter(job.drafter.kind, path, largest, target), curve, cost)


class Engine:
    """Rows in, rows out, for one replica. Knows the tokenizer; `spot` sees token ids only."""

    def __init__(self, job: Job):
        self.job = job
        self.config = job.decoding_config()
        self.tokenizer, self.target = load_model(job)
        self.drafter = build_drafter(job, self.target)
        self.drafter_label = job.drafter_label()
        self.eos_ids = torch.tensor(self.target.eos_ids)
        # sees (rows, errors, generated tokens, forwards) of each generation batch as it
        # finishes: the replica's live progress (tokens to the EOS, before stop strings)
        self.on_batch: Callable[[int, int, int, int], None] | None = None

    def encode(self, row: Mapping[str, Any] | str) -> list[int]:
        """Prompt token ids of a row (or a plain prompt), see `pipeline.prompts.prompt_ids`."""
        row = {PROMPT: row} if isinstance(row, str) else row
        return prompt_ids(self.tokenizer, row, self.job.input)

    def needed_length(self, prompt_length: int) -> int:
        """Positions the target must hold for a prompt of this length (its block grid)."""
        layout = Layout.for_prompt(
            prompt_length,
            self.config.gen_length,
            self.config.block_length,
            self.config.steps_per_block,
            self.target.absolute_block_grid,
            self.target.mask_id,
            self.target.eos_ids,
        )
        return layout.total_length

    def _prompt_ids(
        self, row_error: str | None, row: Mapping[str, Any]
    ) -> tuple[list[int] | None, str | None]:
        if row_error is not None:
            return None, row_error
        try:
            ids = self.encode(row)
        except PromptError as error:
            return None, str(error)
        needed = self.needed_length(len(ids))
        if needed > self.target.max_length:
            return None, (
                f"prompt too long: {len(ids)} tokens + gen_length {self.config.gen_length} "
                f"need {needed} positions, the target accepts {self.target.max_length}"
            )
        return ids, None

    def _generate(self, requests: Sequence[Request]) -> list[Result | str]:
        """Results in request order; a request that fails even alone yields its error text."""
        out: list[Result | str] = []
        size = self.job.resources.batch_size
        for start in range(0, len(requests), size):
            chunk = requests[start : start + size]
            try:
                results = generate(self.target, chunk, self.config, self.drafter)
            except Exception:
                results = self._generate_alone(chunk)
            out.extend(results)
            if self.on_batch is not None:
                done = [r for r in results if not isinstance(r, str)]
                tokens = sum(len(self._completion_ids(r.tokens)) for r in done)
                nfe = sum(r.stats.nfe for r in done)
                self.on_batch(len(results), len(results) - len(done), tokens, nfe)
        return out

    def _generate_alone(self, requests: Sequence[Request]) -> list[Result | str]:
        out: list[Result | str] = []
        for request in requests:
            try:
                out.extend(generate(self.target, [request], self.config, self.drafter))
            except Exception as error:
                out.append(f"generation failed: {type(error).__name__}: {error}")
        return out

    def _completion_ids(self, tokens: torch.Tensor) -> list[int]:
        """Generated ids up to and including the first EOS (the EOS fill after it dropped)."""
        is_eos = torch.isin(tokens, self.eos_ids)
        if bool(is_eos.any()):
            tokens = tokens[: int(is_eos.nonzero()[0, 0]) + 1]
        return tokens.tolist()

    def process(self, batch: pa.Table) -> pa.Table:
        """Output rows for `batch` (columns id, prompt, sample_index, _row_error and the
        carried input columns), in the same order."""
        ids = batch.column(ID).to_pylist()
        rows = [
            {PROMPT: prompt, MESSAGES: messages}
            for prompt, messages in zip(_values(batch, PROMPT), _values(batch, MESSAGES))
        ]
        samples = batch.column(SAMPLE_INDEX).to_pylist()
        row_errors = batch.column(ROW_ERROR).to_pylist()
        columns: dict[str, list] = {f.name: [None] * batch.num_rows for f in GENERATED_FIELDS}
        columns["model"] = [self.job.model.path] * batch.num_rows
        columns["drafter"] = [self.drafter_label] * batch.num_rows
        columns["seed"] = [self.config.seed] * batch.num_rows

        pending: list[int] = []
        requests: list[Request] = []
        for i, (row_id, row, sample, row_error) in enumerate(zip(ids, rows, samples, row_errors)):
            token_ids, error = self._prompt_ids(row_error, row)
            if error is not None:
                columns["error"][i] = error
                columns["finish_reason"][i] = "error"
                continue
            columns["num_prompt_tokens"][i] = len(token_ids)
            key = noise.request_key(row_id, sample)
            requests.append(Request(torch.tensor(token_ids, dtype=torch.long), key))
            pending.append(i)

        auto = self.drafter if isinstance(self.drafter, AutoBudget) else None
        before = Counter(auto.timed) if auto else Counter()
        results = self._generate(requests)
        if auto and batch.num_rows:  # the budgets auto ran at, on the first row (schema)
            columns["budget_iterations"][0] = _budget_iterations(Counter(auto.timed) - before)
        for i, result in zip(pending, results):
            if isinstance(result, str):
                columns["error"][i] = result
                columns["finish_reason"][i] = "error"
                continue
            completion_ids, text, stopped = cut_at_stop(
                self.tokenizer, self._completion_ids(result.tokens), self.job.decoding.stop
            )
            stats = result.stats
            columns["completion"][i] = text
            columns["completion_token_ids"][i] = completion_ids
            columns["num_generated_tokens"][i] = len(completion_ids)
            columns["nfe"][i] = stats.nfe
            columns["steps"][i] = stats.steps
            columns["accepted_steps_per_forward"][i] = stats.steps_per_forward
            columns["tree_nodes_verified"][i] = stats.tree_nodes
            columns["drafter_seconds"][i] = stats.drafter_seconds
            columns["wall_seconds"][i] = stats.wall_seconds
            columns["finish_reason"][i] = "stop" if stopped else result.finish_reason

        texts = [prompt_text(row, self.job.input) for row in rows]
        return _output_table(batch, texts, columns)


def _budget_iterations(ran: Counter) -> list[dict[str, int]]:
    """AutoBudget's iterations per (batch-size class, budget) as the output column holds
    them: class k holds the batch sizes 2**(k-1) .. 2**k - 1."""
    return [
        {
            "batch_size_from": 2 ** (k - 1),
            "batch_size_to": 2**k - 1,
            "budget": budget,
            "iterations": count,
        }
        for (k, budget), count in sorted(ran.items())
    ]


def _values(batch: pa.Table, name: str) -> list[Any]:
    """A column's values, all None when the batch has no such column."""
    if name not in batch.column_names:
        return [None] * batch.num_rows
    return batch.column(name).to_pylist()


def _output_table(batch: pa.Table, texts: list[str | None], columns: dict[str, list]) -> pa.Table:
    """id, prompt (its text or null), the generated fields, sample_index, carried columns
    (the conversation of a messages job among them)."""
    arrays = [batch.column(ID), pa.array(texts, pa.string())]
    names = [ID, PROMPT]
    for field in GENERATED_FIELDS:
        arrays.append(pa.array(columns[field.name], field.type))
        names.append(field.name)
    arrays.append(batch.column(SAMPLE_INDEX))
    names.append(SAMPLE_INDEX)
    for name in batch.column_names:
        if name not in (ID, PROMPT, SAMPLE_INDEX, ROW_ERROR):
            arrays.append(batch.column(name))
            names.append(name)
    return pa.Table.from_arrays(arrays, names=names)
