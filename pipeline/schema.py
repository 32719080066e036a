"""Output columns: the generated fields every part file carries, with fixed Arrow types so
that error-only batches and full batches write the same schema."""

from __future__ import annotations

import pyarrow as pa

ID = "id"
PROMPT = "prompt"
MESSAGES = "messages"  # the conversation of a job with input.messages_column
SAMPLE_INDEX = "sample_index"
INPUT_ERROR = "input"  # error_kind of a row that cannot be generated as given
GENERATION_ERROR = "generation"  # error_kind of a row whose generation failed
ROW_ERROR = "_row_error"  # internal: an error found before generation (null or duplicate id)
PROMPT_IDS = "_prompt_ids"  # internal: the prompt's token ids, from the tokenize stage
INPUT_DIGEST = "input_digest"  # a digest of the row's id and prompt (pipeline.identity)

BUDGET_ITERATIONS = pa.list_(
    pa.struct(
        [
            ("batch_size_from", pa.int64()),
            ("batch_size_to", pa.int64()),
            ("budget", pa.int64()),
            ("iterations", pa.int64()),
        ]
    )
)

GENERATED_FIELDS = (
    pa.field("completion", pa.string()),
    pa.field("completion_token_ids", pa.list_(pa.int64())),
    pa.field("num_prompt_tokens", pa.int64()),
    pa.field("num_generated_tokens", pa.int64()),
    pa.field("nfe", pa.int64()),
    pa.field("steps", pa.int64()),
    pa.field("accepted_steps_per_forward", pa.float64()),
    # this row's share of the target forwards it took part in (1/n of a forward over n
    # requests): sum(nfe) / sum(forward_share) is the mean number of requests per forward
    pa.field("forward_share", pa.float64()),
    pa.field("tree_nodes_verified", pa.int64()),
    pa.field("drafter_seconds", pa.float64()),
    pa.field("wall_seconds", pa.float64()),
    # its prompt's positions whose keys and values came from the replica's prefix cache (or
    # were computed once for it and rows admitted with it), those computed in its name, and
    # the time of computing them (spot.decode.RequestStats)
    pa.field("prompt_tokens_reused", pa.int64()),
    pa.field("prompt_tokens_computed", pa.int64()),
    pa.field("prefill_seconds", pa.float64()),
    pa.field("finish_reason", pa.string()),
    pa.field("error", pa.string()),
    # why a row has an error: "input" (it cannot be generated as given: no id, duplicate id,
    # null / empty / non-string prompt, prompt too long, template error, unreadable line) or
    # "generation" (the target or drafter failed on it; a resubmit may succeed)
    pa.field("error_kind", pa.string()),
    pa.field("model", pa.string()),
    pa.field("drafter", pa.string()),
    pa.field("seed", pa.int64()),
    # budget auto: the iterations its batches ran at each tree budget, per batch-size class
    # (AutoBudget searches per power of two), over the engine call that made this row's block;
    # set on the block's first row only, so the column sums to the job's iterations
    pa.field("budget_iterations", BUDGET_ITERATIONS),
)
