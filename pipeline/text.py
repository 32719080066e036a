"""The text side of generation, steps 1 and 3 of `pipeline.engine` (the CPU stages of a
job, `pipeline.stages`): the checkpoint's tokenizer, each row's prompt ids, and the
completion text cut at the first stop string. No torch: the text stages' actors start
without it."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa

from pipeline.job import InputConfig, Job
from pipeline.prompts import PromptError, cut_at_stop, prompt_ids, prompt_text
from pipeline.schema import GENERATED_FIELDS, MESSAGES, PROMPT, PROMPT_IDS, ROW_ERROR

_FIELDS = {field.name: field for field in GENERATED_FIELDS}


def load_tokenizer(job: Job, directory: Path | None = None) -> Any:
    """The tokenizer of job.model (a hub id not yet cached is downloaded), or of its
    checkpoint `directory` when the caller found it already."""
    from spot_common.tokenizer import load_tokenizer as load

    return load(directory or job.model.path.checkpoint())


def tokenize_rows(tokenizer: Any, config: InputConfig, batch: pa.Table) -> pa.Table:
    """Step 1: `batch` (expanded input rows) with each row's prompt ids (PROMPT_IDS, null
    where the prompt cannot be built: its reason goes to ROW_ERROR) and PROMPT set to the
    text the output's prompt column holds (`pipeline.prompts.prompt_text`)."""
    rows = _prompt_rows(batch)
    errors = batch.column(ROW_ERROR).to_pylist()
    ids: list[list[int] | None] = [None] * batch.num_rows
    for i, row in enumerate(rows):
        if errors[i] is None:
            try:
                ids[i] = prompt_ids(tokenizer, row, config)
            except PromptError as error:
                errors[i] = str(error)
    texts = [prompt_text(row, config) for row in rows]
    batch = with_column(batch, PROMPT, pa.array(texts, pa.string()))
    batch = with_column(batch, ROW_ERROR, pa.array(errors, pa.string()))
    return with_column(batch, PROMPT_IDS, pa.array(ids, pa.list_(pa.int64())))


def detokenize_rows(tokenizer: Any, stops: Sequence[str], batch: pa.Table) -> pa.Table:
    """Step 3: the output rows of `Engine.generate_rows` with their completion text, each
    cut at its first stop string (text, token ids and count; finish reason `stop`)."""
    generated = batch.column("completion_token_ids").to_pylist()
    reasons = batch.column("finish_reason").to_pylist()
    texts: list[str | None] = [None] * batch.num_rows
    for i, ids in enumerate(generated):
        if ids is None:
            continue
        generated[i], texts[i], stopped = cut_at_stop(tokenizer, ids, stops)
        if stopped:
            reasons[i] = "stop"
    counts = [None if ids is None else len(ids) for ids in generated]
    for name, values in (
        ("completion", texts),
        ("completion_token_ids", generated),
        ("num_generated_tokens", counts),
        ("finish_reason", reasons),
    ):
        batch = with_column(batch, name, pa.array(values, _FIELDS[name].type))
    return batch


def _prompt_rows(batch: pa.Table) -> list[dict[str, Any]]:
    """Each row's prompt and messages (None where the batch has no such column), the row
    form `pipeline.prompts` reads."""
    prompts, messages = (
        batch.column(name).to_pylist() if name in batch.column_names else [None] * batch.num_rows
        for name in (PROMPT, MESSAGES)
    )
    return [{PROMPT: p, MESSAGES: m} for p, m in zip(prompts, messages)]


def with_column(batch: pa.Table, name: str, values: pa.Array) -> pa.Table:
    """`batch` with column `name` replaced by `values`, or added at the end."""
    index = batch.schema.get_field_index(name)
    if index < 0:
        return batch.append_column(name, values)
    return batch.set_column(index, name, values)
