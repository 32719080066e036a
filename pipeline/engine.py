"""Rows to completions in three steps, each a Ray Data stage of a job (pipeline.runner):

1. `pipeline.text.tokenize_rows` (a CPU stage): each row's prompt ids, through the chat template;
2. `Engine.generate_rows` (the model replica, holding target and drafter, built once): token
   ids in, token ids out, decoded continuously `resources.batch_size` requests at a time;
3. `pipeline.text.detokenize_rows` (a CPU stage): the completion text, cut at the first stop string.

`Engine.process` runs the three in this process (`spot-pipeline estimate` measures a replica
with it). Every row comes back: a row that cannot be generated (no id, duplicate id, null /
empty / non-string prompt, prompt too long for the target, a failure inside generation)
becomes a row with `error` set and no completion, never a failed batch; a row that fails an
earlier step passes the later ones untouched.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import pyarrow as pa
import torch

from pipeline.decoder import Call, Decoder, Pending, Recording
from pipeline.job import AUTO_PREFIX_CACHE_BYTES, Job
from pipeline.prompts import PromptError, find_stop, prompt_ids
from pipeline.schema import (
    GENERATED_FIELDS,
    GENERATION_ERROR,
    ID,
    INPUT_ERROR,
    PROMPT,
    PROMPT_IDS,
    ROW_ERROR,
    SAMPLE_INDEX,
)
from pipeline.text import detokenize_rows, load_tokenizer, tokenize_rows
from spot import noise
from spot.budget import AcceptanceCurve, AutoBudget, ForwardCost
from spot.decode import Drafter, Request, Result
from spot.drafting import DrafterSlot
from spot.models.prefix_cache import PrefixCache
from spot.target import Target
from spot.tree import Layout

DrafterLoader = Callable[[int | None], tuple[Drafter, AcceptanceCurve]]


def load_model(job: Job) -> tuple[Any, Target]:
    """The tokenizer and target of job.model (a hub id not yet cached is downloaded)."""
    from spot.models.loading import DTYPES, load_target

    directory = job.model.path.checkpoint()
    device = "cuda" if job.resources.num_gpus > 0 else "cpu"  # Ray exposes the replica's GPU
    tokenizer = load_tokenizer(job, directory)
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
    from spot.drafters.registry import acceptance_curve, load_drafter

    if job.drafter.budget != "auto":
        return load_drafter(job.drafter.kind, path, job.drafter.budget, target)
    curve = acceptance_curve(job.drafter.kind, path)
    largest = max(curve.budgets)
    cost = forward_cost(job, target, largest)
    return AutoBudget(load_drafter(job.drafter.kind, path, largest, target), curve, cost)


def forward_cost(job: Job, target: Target, largest: int) -> ForwardCost:
    """This target's forward cost on this machine, at the widths `budget: auto` weighs for
    budgets up to `largest`."""
    from spot.budget import measure_forward_cost

    batch = job.resources.batch_size
    block = job.decoding.block_length
    states = sorted({1, 2, 4, 8, 16, 32, batch, batch * (largest + 1)})
    return measure_forward_cost(target, block, 4 * block, states)


class StopStrings:
    """One request's stop check (`spot.decode.Request.stop`) for the job's stop strings. Each
    call decodes the ids added since the last one, with enough ids before them that a stop
    string across the boundary is seen (at most 4 ids per character: byte-level tokens), and
    confirms an occurrence on the text of all the ids, which is what `cut_at_stop` later
    searches: a request is never stopped without a stop string in its completion."""

    def __init__(self, tokenizer: Any, stops: Sequence[str]):
        self.tokenizer = tokenizer
        self.stops = list(stops)
        self.context = 4 * max(len(stop) for stop in self.stops) + 4
        self.checked = 0  # ids decoded by the last call

    def __call__(self, ids: torch.Tensor) -> bool:
        if ids.numel() <= self.checked:  # the request is decoded again from its start
            self.checked = 0
        new = ids[max(0, self.checked - self.context) :].tolist()
        self.checked = ids.numel()
        if find_stop(self._text(new), self.stops) is None:
            return False
        return find_stop(self._text(ids.tolist()), self.stops) is not None

    def _text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


class Engine:
    """The model replica's step: token ids in, token ids out. Holds the tokenizer for stop
    checks and for callers that have no tokenize stage; `spot` sees token ids only."""

    def __init__(self, job: Job):
        self.job = job
        self.config = job.decoding_config()
        self.tokenizer, self.target = load_model(job)
        self.drafter: Drafter | None = build_drafter(job, self.target)
        self.drafter_label = job.drafter_label()
        self._autos = [self.drafter] if isinstance(self.drafter, AutoBudget) else []
        self._cost: ForwardCost | None = None  # measured once, for every drafter handed over
        if job.drafter.learn:  # drafters are handed over while it decodes (`use_drafter`)
            self.drafter = DrafterSlot(self.drafter)
            if self._autos:
                self._cost = self._autos[0].cost
            elif job.drafter.budget == "auto":  # here: the loop will be using the target
                largest = max(job.drafter.learning.learner_config().budgets)
                self._cost = forward_cost(job, self.target, largest)
        # records the rows it decodes, for a job that learns its drafter (pipeline.learning)
        self.recording: Recording | None = None
        self.eos_ids = torch.tensor(self.target.eos_ids)
        self.prefix_cache = make_prefix_cache(job, self.target)
        # sees (call name, its rows, errors, generated tokens, forwards so far) every
        # resources.batch_size rows the replica finishes: live progress (tokens before stop
        # strings are cut)
        self.on_progress: Callable[[str, tuple[int, int, int, int]], None] | None = None
        # sees the first line of each failed batch's error
        self.on_failure: Callable[[str], None] | None = None
        self._decoder: Decoder | None = None
        self._progress_lock = threading.Lock()
        self._changed: dict[int, RowsInFlight] = {}
        self._since_report = 0
        self._budget_seen: Counter = Counter()

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

    def length_problem(self, prompt_length: int) -> str | None:
        """Why a prompt of this many ids cannot be generated (too long), None if it can."""
        needed = self.needed_length(prompt_length)
        if needed <= self.target.max_length:
            return None
        return (
            f"prompt too long: {prompt_length} tokens + gen_length {self.config.gen_length} "
            f"need {needed} positions, the target accepts {self.target.max_length}"
        )

    def prompt_ids(
        self, row_error: str | None, row: Mapping[str, Any]
    ) -> tuple[list[int] | None, str | None]:
        """A row's prompt ids, or why it cannot be generated (its earlier error, a prompt
        that cannot be built, one too long for the target), decided as a job's stages decide
        it: for callers that tokenize in the replica (recording)."""
        if row_error is not None:
            return None, row_error
        try:
            ids = self.encode(row)
        except PromptError as error:
            return None, str(error)
        problem = self.length_problem(len(ids))
        return (None, problem) if problem else (ids, None)

    def process(self, batch: pa.Table) -> pa.Table:
        """Output rows for `batch` (columns id, prompt or messages, sample_index, _row_error
        and the carried input columns), in the same order: the three steps in this process."""
        tokenized = tokenize_rows(self.tokenizer, self.job.input, batch)
        generated = self.generate_rows(tokenized)
        return detokenize_rows(self.tokenizer, self.job.decoding.stop, generated)

    def generate_rows(self, batch: pa.Table) -> pa.Table:
        """Step 2: tokenized rows (`tokenize_rows`) to output rows holding the generated ids
        (completion_token_ids, to the first EOS or the end of the block that held a stop
        string; `detokenize_rows` cuts and decodes them), in the same order. A row with an
        error comes back as an error row without being decoded."""
        rows = self.submit_rows(batch)
        rows.call.done.result()
        return rows.table()

    def submit_rows(self, batch: pa.Table, name: str = "") -> RowsInFlight:
        """Step 2, started: the rows' requests join the replica's decode loop, behind those
        of its other calls (this call's sorted by prompt ids, so rows that share a prefix
        decode together); `RowsInFlight.table()` once `.call.done`. `name` names the call in
        progress reports."""
        rows = RowsInFlight(self, batch, name)
        self.decoder.submit(rows.pending)
        return rows

    @property
    def decoder(self) -> Decoder:
        """The replica's one decode loop (`pipeline.decoder`), made on first use."""
        if self._decoder is None:
            self._decoder = Decoder(
                self.target,
                self.config,
                self.drafter,
                max_active=self.job.resources.batch_size,
                prefix_cache=self.prefix_cache,
                max_error_rate=self.job.resources.max_error_rate,
                recording=self.recording,
            )
            self._decoder.on_failure = self.on_failure
        return self._decoder

    def _stop_check(self) -> StopStrings | None:
        stops = self.job.decoding.stop
        return StopStrings(self.tokenizer, stops) if stops else None

    def _finished(self, rows: RowsInFlight) -> None:
        """Progress: every resources.batch_size rows the replica finishes, the counts of the
        calls they belong to."""
        if self.on_progress is None:
            return
        with self._progress_lock:
            self._changed[id(rows)] = rows
            self._since_report += 1
            if self._since_report < self.job.resources.batch_size and rows.call.left:
                return
            changed, self._changed, self._since_report = list(self._changed.values()), {}, 0
        for call in changed:
            self.on_progress(call.name, tuple(call.counts))

    def use_drafter(self, kind: str | None, load: DrafterLoader, label: str) -> None:
        """Hand a new drafter to the decode loop, which takes it at its next iteration (a
        job that learns its drafter; tokens stay the target's own, `DrafterSlot`). `load`
        gives it for a budget (None: its curve's largest) with its acceptance curve; with
        budget auto it is wrapped anew for its own curve, with the forward cost measured
        once (a new drafter changes the steps a budget brings, not what a forward costs)."""
        if not isinstance(self.drafter, DrafterSlot):
            raise ValueError("this engine's drafter is fixed (drafter.learn: false)")
        drafter = None
        if kind is not None:
            budget = self.job.drafter.budget
            drafter, curve = load(None if budget == "auto" else budget)
            if budget == "auto":
                drafter = AutoBudget(drafter, curve, self._cost)
                with self._progress_lock:
                    self._autos.append(drafter)
        self.drafter.put(drafter)
        self.drafter_label = label

    def budget_iterations(self) -> list[dict[str, int]] | None:
        """With budget auto, the iterations it ran at each budget since the last call asked
        (each call takes those of its time, so the column sums to the job's; with drafters
        handed over, those of every one of them)."""
        if self.job.drafter.budget != "auto" or not self._autos:
            return None
        with self._progress_lock:
            now = sum((Counter(auto.timed) for auto in self._autos), Counter())
            ran, self._budget_seen = now - self._budget_seen, now
        return _budget_iterations(ran)

    def completion_ids(self, result: Result) -> list[int]:
        """Generated ids up to and including the first EOS (the EOS fill after it dropped);
        for a request its stop check ended, up to the end of that block (no EOS kept: the
        first one is the fill)."""
        tokens = result.tokens
        is_eos = torch.isin(tokens, self.eos_ids)
        if bool(is_eos.any()):
            end = int(is_eos.nonzero()[0, 0])
            tokens = tokens[: end if result.finish_reason == "stop" else end + 1]
        return tokens.tolist()


class RowsInFlight:
    """One call's rows while the decoder works on them: the error rows made at once (their
    `error_kind` "input"), a request per row that can be generated, and the counts of those
    finished so far."""

    def __init__(self, engine: Engine, batch: pa.Table, name: str):
        self.engine = engine
        self.batch = batch
        self.name = name
        self.counts = [0, 0, 0, 0]  # rows, errors, generated tokens, forwards finished
        ids = batch.column(ID).to_pylist()
        samples = batch.column(SAMPLE_INDEX).to_pylist()
        errors = batch.column(ROW_ERROR).to_pylist()
        prompts = batch.column(PROMPT_IDS).to_pylist()
        n = batch.num_rows
        self.columns: dict[str, list] = {f.name: [None] * n for f in GENERATED_FIELDS}
        self.columns["model"] = [engine.job.model.path.text] * n
        self.columns["drafter"] = [engine.drafter_label] * n
        self.columns["seed"] = [engine.config.seed] * n
        generated = []
        for i, (error, token_ids) in enumerate(zip(errors, prompts)):
            error = error or engine.length_problem(len(token_ids))
            if error is not None:
                self._error(i, error, INPUT_ERROR)
            else:
                self.columns["num_prompt_tokens"][i] = len(token_ids)
                generated.append(i)
        generated.sort(key=lambda i: prompts[i])  # rows that share a prefix decode together
        self.rows = generated  # the batch row of each request
        self.call = Call(len(generated), self._outcome)
        several = engine.job.decoding.samples_per_prompt > 1
        self.pending = [
            Pending(
                Request(
                    torch.tensor(prompts[i], dtype=torch.long),
                    noise.request_key(ids[i], samples[i]),
                    engine._stop_check(),
                ),
                f"{ids[i]} (sample {samples[i]})" if several else str(ids[i]),
                self.call,
                position,
            )
            for position, i in enumerate(generated)
        ]
        self.budget: list[dict[str, int]] | None = None

    def _error(self, i: int, error: str, kind: str) -> None:
        self.columns["error"][i] = error
        self.columns["error_kind"][i] = kind
        self.columns["finish_reason"][i] = "error"

    def _outcome(self, position: int, outcome: Result | str | None) -> None:
        """A request's outcome, as the decoder resolves it."""
        if outcome is None:  # let go unfinished: not written
            return
        i = self.rows[position]
        self.counts[0] += 1
        if isinstance(outcome, str):
            self.counts[1] += 1
            self._error(i, outcome, GENERATION_ERROR)
        else:
            self._result(i, outcome)
        if not self.call.left:  # its last row: the budgets auto ran at while it decoded
            self.budget = self.engine.budget_iterations()
        self.engine._finished(self)

    def _result(self, i: int, result: Result) -> None:
        completion_ids = self.engine.completion_ids(result)
        stats, columns = result.stats, self.columns
        columns["completion_token_ids"][i] = completion_ids
        columns["num_generated_tokens"][i] = len(completion_ids)
        columns["nfe"][i] = stats.nfe
        columns["steps"][i] = stats.steps
        columns["accepted_steps_per_forward"][i] = stats.steps_per_forward
        columns["forward_share"][i] = stats.forward_share
        columns["tree_nodes_verified"][i] = stats.tree_nodes
        columns["drafter_seconds"][i] = stats.drafter_seconds
        columns["wall_seconds"][i] = stats.wall_seconds
        columns["prompt_tokens_reused"][i] = stats.prompt_tokens_reused
        columns["prompt_tokens_computed"][i] = stats.prompt_tokens_computed
        columns["prefill_seconds"][i] = stats.prefill_seconds
        columns["finish_reason"][i] = result.finish_reason
        columns["drafter"][i] = self.engine.drafter_label  # the one in use when it finished
        self.counts[2] += len(completion_ids)
        self.counts[3] += stats.nfe

    def table(self) -> pa.Table:
        """The output rows, in the batch's order, once the call is done: its error rows and
        every finished row; rows let go unfinished (a drain) are left out."""
        let_go = {
            self.rows[position]
            for position, outcome in enumerate(self.call.outcomes)
            if outcome is None
        }
        if self.batch.num_rows and self.budget is not None and 0 not in let_go:
            self.columns["budget_iterations"][0] = self.budget
        table = _output_table(self.batch, self.columns)
        if not let_go:
            return table
        kept = [i for i in range(self.batch.num_rows) if i not in let_go]
        return table.take(pa.array(kept, pa.int64()))


def make_prefix_cache(job: Job, target: Target) -> PrefixCache | None:
    """The replica's prefix cache (`resources.prefix_cache_bytes`): auto gives one of
    AUTO_PREFIX_CACHE_BYTES to a target that can take one, and none to another; a size
    asked of a target that cannot take one is refused, with the target's reason."""
    size = job.resources.prefix_cache_bytes
    if size == 0:
        return None
    problem = target.prefix_cache_problem
    if problem is not None:
        if size == "auto":
            return None
        raise ValueError(f"resources.prefix_cache_bytes: {problem}; set 0 or auto")
    budget = AUTO_PREFIX_CACHE_BYTES if size == "auto" else size
    return PrefixCache(budget, job.decoding.block_length)


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


INTERNAL = (ROW_ERROR, PROMPT_IDS)  # columns between the steps, never written


def _output_table(batch: pa.Table, columns: dict[str, list]) -> pa.Table:
    """id, prompt (its text or null), the generated fields, sample_index, carried columns
    (the conversation of a messages job among them)."""
    arrays = [batch.column(ID), batch.column(PROMPT)]
    names = [ID, PROMPT]
    for field in GENERATED_FIELDS:
        arrays.append(pa.array(columns[field.name], field.type))
        names.append(field.name)
    arrays.append(batch.column(SAMPLE_INDEX))
    names.append(SAMPLE_INDEX)
    for name in batch.column_names:
        if name not in (ID, PROMPT, SAMPLE_INDEX, *INTERNAL):
            arrays.append(batch.column(name))
            names.append(name)
    return pa.Table.from_arrays(arrays, names=names)
