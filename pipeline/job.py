"""The job file: a typed, validated description of one batch-generation run.

`load_job` reads a YAML file, applies `--set key.path=value` overrides, validates everything
that can be checked without starting Ray (schema, decoding arithmetic, builtin names, paths,
drafters that exist, the family against the checkpoint, a writable output folder, hub ids the
hub lists, GPUs for tensor parallel ranks) and returns a `Job`. Errors name the key:
`decoding.block_length: ...`. The validated object is passed down as is; nothing downstream
reads raw dicts.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PlainSerializer,
    PlainValidator,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic.dataclasses import dataclass as pydantic_dataclass

from pipeline.locations import GLOB_CHARACTERS, Kind, Location
from spot.builtin import builtin_drafter
from spot.config import CommitRule, DecodingConfig
from spot.drafters.registry import DRAFTERS, drafter_kind
from spot.models.family_index import FAMILY_INDEX, family_reading
from spot.models.hub import hub_problem

# resources.prefix_cache_bytes: auto, where the target can take a prefix cache: enough for a
# few thousand tokens of prefixes of an 8B target (~144 KiB per token in bfloat16)
AUTO_PREFIX_CACHE_BYTES = 256 * 2**20
# resources.max_error_rate is taken over this many of a replica's most recent rows
ERROR_WINDOW = 100


class JobError(ValueError):
    """A job that cannot run; `problems` holds one `key.path: message` line per problem."""

    def __init__(self, problems: Sequence[str]):
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _location_type(hub_id: bool) -> Any:
    """A path key: validated into a `Location` (see pipeline.locations), written back as
    the user wrote it."""

    def parse(value: Any) -> Location:
        return value if isinstance(value, Location) else Location.parse(value, hub_id=hub_id)

    return Annotated[
        Location, PlainValidator(parse), PlainSerializer(lambda where: where.text, return_type=str)
    ]


PathLocation = _location_type(hub_id=False)
ModelLocation = _location_type(hub_id=True)  # `org/name` may be a hub id


class InputConfig(_Section):
    path: PathLocation = Field(
        description="Parquet prompts: a file, a folder, a glob, a URI (s3://, gs://, ...) or "
        "builtin:<name> for prompts shipped with the package."
    )
    id_column: str = Field(
        "id",
        description="Unique row id; the output's `id` column, the resume key and, with the job "
        "seed, the coupled-noise key, so a row's completion does not depend on batching.",
    )
    prompt_column: str = Field(
        "prompt", description="Column holding the prompt text (unused with messages_column)."
    )
    messages_column: str | None = Field(
        None,
        description="Column holding a conversation instead of a prompt: a list of {role, "
        "content} turns (system, user, assistant), as OpenAI and Ray Data LLM take it; needs "
        "chat_template. The output's `prompt` is the last user turn and the conversation is "
        "carried as `messages`.",
    )
    system_prompt: str | None = Field(
        None,
        description="A system turn put before every conversation that has none (plain prompts "
        "and messages alike); needs chat_template.",
    )
    chat_template: bool = Field(
        True,
        description="Wrap each prompt as a user turn of the tokenizer's chat template (instruct "
        "targets); false feeds the raw text (base targets, few-shot prompts).",
    )
    limit: int | None = Field(
        None, gt=0, description="Only the first N input rows (smoke runs); None reads them all."
    )


class ModelConfig(_Section):
    path: ModelLocation = Field(
        description="builtin:<name>, a local checkpoint directory in the family's original "
        "format, or a hub id (taken from the local cache, else downloaded by each replica); "
        "no remote code runs."
    )
    family: str | None = Field(
        None,
        description="Architecture family (one of spot.models.registry's); None reads it from "
        "the checkpoint's config.json.",
    )
    dtype: Literal["float32", "bfloat16", "float64"] = Field(
        "float32",
        description="bfloat16 halves memory and is faster on GPUs but its rounding can flip near-"
        "ties, so completions may depend on batching; float64 (CPU) is exact and slow.",
    )
    tensor_parallel: int = Field(
        1,
        ge=1,
        description="Ranks (one process each, one GPU each on GPUs) the target is sharded over "
        "inside every replica, with DeepSpeed; for targets too large for one GPU. Must divide "
        "the model's attention and key/value heads.",
    )

    @field_validator("family")
    @classmethod
    def _registered_family(cls, value: str | None) -> str | None:
        if value is not None and value not in family_names():
            raise ValueError(f"unknown family {value!r}; one of {_one_of(family_names())}")
        return value


class LearningConfig(_Section):
    """How a job that learns its drafter learns it (`drafter.learn`). A key left out takes
    the learner's own default (`spot.drafters.learning.LearnerConfig`, docs/benchmarks.md
    §5.3-5.4), which this section names rather than repeats."""

    heldout_percent: int | None = Field(
        None,
        ge=0,
        le=99,
        description="Rows (chosen by request key) kept out of training: every new drafter is "
        "measured on them, by replaying their recorded decoding (no target forward).",
    )
    validation_percent: int | None = Field(
        None, ge=0, le=99, description="Rows that pick SPOT's epoch and tree shape."
    )
    spiffy_rows: int | None = Field(
        None, ge=1, description="Rows decoded before Spiffy's first calibration."
    )
    spot_rows: tuple[int, ...] | None = Field(
        None,
        min_length=1,
        description="Rows decoded at each SPOT round (increasing): the first when the order "
        "model starts to pay, then each time the rows double.",
    )
    min_spot_rounds: int | None = Field(
        None, ge=1, description="SPOT rounds before the gain may stop learning."
    )
    min_gain: float | None = Field(
        None,
        ge=0.0,
        description="Learning stops once a SPOT round gained so little over the last one "
        "(held-out steps per forward) that the next, worth about half as much, would gain "
        "less than this.",
    )
    epochs: int | None = Field(None, ge=1, description="Epochs of the first SPOT round.")
    warm_epochs: int | None = Field(
        None, ge=1, description="Epochs of later rounds, which start from the last model."
    )
    batch_size: int | None = Field(None, ge=1, description="Training batch size.")
    budgets: tuple[int, ...] | None = Field(
        None, min_length=1, description="Budgets whose held-out steps per forward are reported."
    )
    decision_budget: int | None = Field(
        None,
        ge=1,
        description="The budget a new drafter must take fewer forwards at (held out) than "
        "the one in use to be handed out; one of budgets.",
    )
    replay_rows: int | None = Field(
        None, ge=1, description="Held-out rows replayed to measure each drafter."
    )
    num_cpus: float = Field(
        1.0,
        gt=0.0,
        description="CPUs of the learner (one Ray actor beside the replicas); it trains and "
        "measures there.",
    )
    num_gpus: float = Field(
        0.0,
        ge=0.0,
        description="GPUs of the learner: with any, it trains SPOT's order model on its GPU "
        "(a fraction shares one with replicas that leave it room, e.g. 0.2 beside replicas "
        "of num_gpus 0.8).",
    )

    @field_validator("spot_rows")
    @classmethod
    def _increasing(cls, value: tuple[int, ...] | None) -> tuple[int, ...] | None:
        if value is not None and (value[0] < 1 or any(b <= a for a, b in zip(value, value[1:]))):
            raise ValueError("must be positive and increasing")
        return value

    def learner_config(self) -> Any:
        """The learner's `LearnerConfig`: the keys given, its defaults for the rest (imports
        the learner, and torch: call it where it runs, or to check the section)."""
        from spot.drafters.learning import LearnerConfig

        given = self.model_dump(exclude={"num_cpus", "num_gpus"}, exclude_none=True)
        return LearnerConfig(**given, device="cuda" if self.num_gpus else "cpu")


class DrafterConfig(_Section):
    kind: Literal[("none", *DRAFTERS)] = Field(
        "none",
        description="none decodes draft-free; the others propose trees of future states that "
        "one target forward verifies (same output, fewer forwards).",
    )
    path: PathLocation | None = Field(
        None,
        description="builtin:<name> or a drafter file; omitted with a bundled target, the "
        "bundled drafter of this kind for that target is used.",
    )
    budget: int | Literal["auto"] = Field(
        16,
        description="Tree nodes verified per request per forward: larger trees accept more steps "
        "per forward but make each forward wider. auto measures this machine's forward cost "
        "as the verified width grows (at replica start) and picks, per batch size, the budget "
        "with the most expected steps per second from the drafter's acceptance curve (measured "
        "after training for spot and spot-sets, predicted by the calibration counts for "
        "spiffy); 0 (draft-free) is a legal outcome. While decoding, the budget in use takes "
        "turns with others, iteration by iteration (a drafting budget with draft-free and its "
        "neighbours on the curve, draft-free with the drafting budget the cost model ranks "
        "best), and gives way to one that shows 5% more measured steps per second (proposal "
        "and verification timed, steps counted; draft-free needs no margin, and a new budget "
        "meets the one it replaced once more); they are met again every 256 iterations. A "
        "number forces that budget.",
    )

    learn: bool = Field(
        False,
        description="Learn the drafter from the job's own rows while it runs (kind spot, "
        "static rule): the replicas record each row's decoding as they go (no extra target "
        "forward) for one learner, which calibrates Spiffy as soon as it has "
        "learning.spiffy_rows rows, then trains SPOT in rounds as the rows double, and hands "
        "each drafter that takes fewer forwards on held-out rows to every replica without "
        "restarting it; it stops when a round no longer pays. Starts from drafter.path "
        "(draft-free when left out); writes each drafter and rounds.json under "
        "<output.path>/drafter/, and a resubmit starts from the last one handed out.",
    )
    learning: LearningConfig = LearningConfig()

    @field_validator("budget")
    @classmethod
    def _budget_positive(cls, value: int | str) -> int | str:
        if isinstance(value, int) and value < 1:
            raise ValueError("must be at least 1")
        return value


@pydantic_dataclass(frozen=True, config=ConfigDict(extra="forbid"))
class DecodingSection(DecodingConfig):
    """The job's `decoding` keys: the decoding core's own `spot.config.DecodingConfig` (its
    fields, defaults and checks), and the two keys the pipeline adds around the core, which
    sees token ids only. The core's keys:

    gen_length       new positions per request
    block_length     positions decoded together; divides gen_length
    rule             static commits tokens_per_step positions per step (fixed NFE); threshold
                     commits every position at least `threshold` confident (fewer NFE, the
                     output depends on the threshold); sdar_dynamic is SDAR's variant of it
    tokens_per_step  static commits per step; divides block_length
    threshold        the confidence threshold
    temperature      0 is greedy; > 0 samples with coupled noise keyed by the seed
    top_k, top_p     sample among the k likeliest tokens, within the nucleus mass p
    confidence       which probability ranks positions at T > 0; None follows the family
                     (SDAR and Dream tempered, LLaDA untempered)
    seed             the job seed of the coupled noise (at least 0)
    """

    samples_per_prompt: int = Field(
        1,
        ge=1,
        description="Completions per prompt, each with its own noise key and `sample_index` "
        "(rejection sampling, preference pairs); useful with temperature > 0.",
    )
    stop: tuple[str, ...] = Field(
        (),
        description="Stop strings: a completion ends just before the first one it holds "
        "(finish_reason `stop`), its token ids at the token that holds the stop's start.",
    )

    @field_validator("stop", mode="before")
    @classmethod
    def _one_stop_string(cls, value: Any) -> Any:
        """A single string is one stop string (`stop: "####"`, `--set decoding.stop=####`)."""
        return (value,) if isinstance(value, str) else value

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.seed < 0:  # a job's seed is recorded and compared as written
            raise ValueError("seed must be >= 0")
        if any(not stop for stop in self.stop):
            raise ValueError("stop strings must not be empty")
        if self.samples_per_prompt > 1 and self.greedy_setting():
            key, remedy = self.greedy_setting()
            n = self.samples_per_prompt
            raise ValueError(
                f"samples_per_prompt ({n}) with {key} makes {n} identical completions at "
                f"{n}x the cost: set {remedy} to sample, or decoding.samples_per_prompt: 1"
            )

    def greedy_setting(self) -> tuple[str, str] | None:
        """The setting that makes every sample of a prompt the same completion, and what
        to change instead, as messages name them; None when samples differ. Temperature 0 is
        greedy; so is top_k 1 at any temperature (the noise then picks the likeliest token
        every time, and confidences do not depend on it)."""
        if self.temperature == 0:
            return "decoding.temperature 0 (greedy)", "decoding.temperature above 0"
        if self.top_k == 1:
            return (
                "decoding.top_k 1 (greedy at any decoding.temperature)",
                "decoding.top_k above 1 (or null)",
            )
        return None

    def to_config(self) -> DecodingConfig:
        """The decoding core's own config (samples_per_prompt and stop are the pipeline's)."""
        core = dataclasses.fields(DecodingConfig)
        return DecodingConfig(**{field.name: getattr(self, field.name) for field in core})

    @staticmethod
    def key_of(message: str) -> str:
        """The key a check's message names first ("seed" for "seed must be >= 0")."""
        names = [field.name for field in dataclasses.fields(DecodingSection)]
        named = [(match.start(), match[0]) for match in _NAME.finditer(message)]
        return next((name for _, name in sorted(named) if name in names), "")


_NAME = re.compile(r"[a-z_]+")


class ResourcesConfig(_Section):
    replicas: int = Field(
        1, ge=1, description="Actors each holding one copy of the target (data parallelism)."
    )
    batch_size: int = Field(
        8,
        ge=1,
        description="Requests decoded together by one replica: larger batches use the "
        "accelerator better but finished requests leave the batch, so very large ones idle.",
    )
    num_gpus: float = Field(0.0, ge=0.0, description="GPUs per replica (0 on CPU).")
    num_cpus: float = Field(
        1.0,
        gt=0.0,
        description="CPUs per replica; also its torch thread count. On a small machine keep "
        "replicas * num_cpus at or below the cores you have.",
    )
    prefix_cache_bytes: int | Literal["auto"] = Field(
        "auto",
        description="Bytes of prompt-prefix keys and values a replica keeps, on the target's "
        "device, so a prefix its rows share (a system prompt, few-shot examples) is computed "
        "once per replica (block-causal targets: SDAR, LLaDA2.0; exact). auto: "
        f"{AUTO_PREFIX_CACHE_BYTES // 2**20} MiB where the target can take one, none where it "
        "cannot (bidirectional LLaDA and Dream, tensor parallel); 0: off.",
    )
    max_error_rate: float = Field(
        0.5,
        ge=0.0,
        le=1.0,
        description="Stop the job when more than this share of a replica's last "
        f"{ERROR_WINDOW} rows failed in generation (a bug, a broken checkpoint, out of memory "
        "at batch 1), naming the most common error and example rows; what was written is "
        "kept. 1 never stops. Rows that cannot be generated as given (bad input) do not count.",
    )
    grace_seconds: float = Field(
        20.0,
        ge=0.0,
        description="On SIGTERM or SIGINT (a scheduler, a preempted node, Ctrl-C) the run "
        "admits no new rows and its replicas finish the rows they are decoding for up to this "
        "long; what finished is written, the rest is left for a resubmit. Keep it a few "
        "seconds under the time your scheduler waits before SIGKILL (Kubernetes: 30 s).",
    )

    @field_validator("prefix_cache_bytes")
    @classmethod
    def _cache_size(cls, value: int | str) -> int | str:
        if isinstance(value, int) and value < 0:
            raise ValueError("must be 0 (off), a number of bytes or auto")
        return value


class OutputConfig(_Section):
    path: PathLocation = Field(
        description="Output folder (or URI): Parquet parts under data/, summary.json and the "
        "report beside it. Submitting again to the same path resumes: ids already written "
        "are skipped."
    )


class CostConfig(_Section):
    usd_per_replica_hour: float = Field(
        0.0, ge=0.0, description="Price of one replica for an hour, for $/1M tokens."
    )
    usd_per_gpu_hour: float = Field(
        0.0,
        ge=0.0,
        description="Price of one GPU for an hour; a replica costs it times its num_gpus. "
        "Give this or usd_per_replica_hour.",
    )

    @model_validator(mode="after")
    def _one_price(self) -> CostConfig:
        if self.usd_per_replica_hour and self.usd_per_gpu_hour:
            raise ValueError("give usd_per_replica_hour or usd_per_gpu_hour, not both")
        return self

    def replica_hour_price(self, gpus_per_replica: float) -> float:
        """USD per replica-hour."""
        return self.usd_per_replica_hour or self.usd_per_gpu_hour * gpus_per_replica


class Job(_Section):
    name: str = Field(min_length=1, description="A name for logs and the summary.")
    input: InputConfig
    model: ModelConfig
    drafter: DrafterConfig = DrafterConfig()
    decoding: DecodingSection = DecodingSection()
    resources: ResourcesConfig = ResourcesConfig()
    output: OutputConfig
    cost: CostConfig = CostConfig()

    @model_validator(mode="after")
    def _sharded_replicas_fit(self) -> Job:
        """Tensor parallel ranks run one per GPU (or all on CPU), in a dtype DeepSpeed runs."""
        degree, gpus, dtype = self.model.tensor_parallel, self.resources.num_gpus, self.model.dtype
        if degree == 1:
            return self
        from spot.models.tensor_parallel import SHARDED_DTYPES

        if gpus and gpus != degree:
            raise ValueError(
                f"resources.num_gpus: a replica of tensor_parallel {degree} runs one rank per "
                f"GPU; set num_gpus: {degree} (or 0 on CPU), not {gpus:g}"
            )
        if dtype not in SHARDED_DTYPES:
            raise ValueError(
                f"model.dtype: tensor_parallel {degree} shards with DeepSpeed, which runs "
                f"{' or '.join(SHARDED_DTYPES)}, not {dtype}"
            )
        return self

    @model_validator(mode="after")
    def _chat_input_needs_template(self) -> Job:
        for key in ("messages_column", "system_prompt"):
            if getattr(self.input, key) is not None and not self.input.chat_template:
                raise ValueError(f"input.{key}: needs input.chat_template: true")
        return self

    @model_validator(mode="after")
    def _learning_fits(self) -> Job:
        """A learning job learns Spiffy, then SPOT: drafters of the static rule, one commit
        per step. Under the threshold rules it is refused (SPOT-Sets and Spiffy for them are
        made before the job, with the drafter commands)."""
        drafter = self.drafter
        if not drafter.learn:
            if drafter.learning != LearningConfig():
                raise ValueError("drafter.learning: set only with drafter.learn: true")
            return self
        if drafter.kind != "spot":
            raise ValueError(
                f"drafter.learn: learns a spot drafter (Spiffy first, then SPOT); set "
                f"drafter.kind: spot, not {drafter.kind}"
            )
        if self.decoding.rule != CommitRule.STATIC or self.decoding.tokens_per_step != 1:
            raise ValueError(
                "drafter.learn: the learner makes Spiffy and SPOT drafters, which draft for "
                "the static rule with tokens_per_step: 1, not decoding.rule "
                f"{self.decoding.rule.value!r} with tokens_per_step "
                f"{self.decoding.tokens_per_step}; for the threshold rules train spot-sets or "
                "calibrate spiffy before the job (README) and set drafter.learn: false"
            )
        try:
            drafter.learning.learner_config()
        except (TypeError, ValueError) as error:
            raise ValueError(f"drafter.learning: {error}") from error
        return self

    @model_validator(mode="after")
    def _drafter_fits_rule(self) -> Job:
        """The rules a kind drafts for are its drafter class's (read through the registry)."""
        if self.drafter.kind == "none":
            return self
        kind, rule = drafter_kind(self.drafter.kind), self.decoding.rule
        if rule not in kind.rules:
            fits = [k.name for k in DRAFTERS.values() if rule in k.rules]
            raise ValueError(
                f"drafter.kind: {kind.name} drafts for the {'/'.join(kind.rules)} rule, "
                f"not decoding.rule {rule!r}; use drafter.kind {' or '.join(fits)} (or none)"
            )
        one_token = kind.one_token_per_static_step and rule == CommitRule.STATIC
        if one_token and self.decoding.tokens_per_step != 1:
            raise ValueError(
                f"drafter.kind: {kind.name} drafts one token per step (tokens_per_step: 1)"
            )
        return self

    def decoding_config(self) -> DecodingConfig:
        return self.decoding.to_config()

    def drafter_path(self) -> str | None:
        """The drafter file: drafter.path, or the bundled drafter of this kind for a bundled
        target, its block length and commit rule. None when decoding draft-free."""
        if self.drafter.kind == "none":
            return None
        if self.drafter.path is not None:
            return self.drafter.path.resolved
        if self.drafter.learn:  # learns its own from draft-free decoding
            return None
        if self.model.path.kind != Kind.BUILTIN:
            raise ValueError("required unless the target is bundled (builtin:<name>)")
        return str(
            builtin_drafter(
                self.model.path.text,
                self.drafter.kind,
                self.decoding.block_length,
                self.decoding.rule,
            )
        )

    def drafter_label(self) -> str:
        """How the output's `drafter` column names the drafter."""
        if self.drafter.kind == "none" or (self.drafter.learn and self.drafter.path is None):
            return "none"
        path = self.drafter.path
        return f"{self.drafter.kind}:{'bundled' if path is None else path.text}"

    def portable(self) -> Job:
        """The job with local paths made absolute, so a cluster's machines read the same
        files."""

        def section(config: _Section) -> _Section:
            path = config.path
            return (
                config if path is None else config.model_copy(update={"path": path.made_portable()})
            )

        return self.model_copy(
            update={
                name: section(getattr(self, name))
                for name in ("input", "model", "drafter", "output")
            }
        )

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


def family_names() -> list[str]:
    """The target families, sorted (from their index: no torch)."""
    return sorted(FAMILY_INDEX)


def _one_of(names: Sequence[str]) -> str:
    """`a, b or c`."""
    return " or ".join([", ".join(names[:-1]), names[-1]] if len(names) > 1 else names)


def parse_overrides(overrides: Iterable[str]) -> list[tuple[list[str], Any]]:
    """`key.path=value` pairs; values are YAML, as the job file writes them: `8`, `0.5`,
    `true`, `null`, `text`, lists (`["####", "Q:"]`) and mappings (`{replicas: 2}`). A value
    YAML reads as a comment (`####`) is that text."""
    parsed = []
    for item in overrides:
        key, sep, raw = item.partition("=")
        keys = key.strip().split(".")
        if not sep or not all(keys):
            raise JobError([f"--set {item}: expected key.path=value"])
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError as error:
            reason = _yaml_problem(error)
            raise JobError([f"{key}: --set cannot parse {raw!r} as YAML: {reason}"]) from error
        if value is None and raw.strip() not in _YAML_NULLS:
            value = raw  # text YAML reads as a comment, not a null someone wrote
        parsed.append((keys, value))
    return parsed


_YAML_NULLS = ("null", "Null", "NULL", "~")


def _yaml_problem(error: yaml.YAMLError) -> str:
    """What YAML found wrong, in one line ("expected ',' or ']' at column 6")."""
    problem, mark = getattr(error, "problem", None), getattr(error, "problem_mark", None)
    if problem is None:
        return " ".join(str(error).split())
    return problem if mark is None else f"{problem} at column {mark.column + 1}"


def apply_overrides(data: dict[str, Any], overrides: Iterable[str]) -> dict[str, Any]:
    """A copy of `data` with the overrides applied: a mapping is merged into the mapping it
    names (`--set 'resources={replicas: 2}'` keeps the other resources keys), any other
    value replaces it. Unknown keys are left for the schema to reject, with their full
    path."""
    data = yaml.safe_load(yaml.safe_dump(data))
    for keys, value in parse_overrides(overrides):
        node = data
        for depth, key in enumerate(keys[:-1]):
            child = node.setdefault(key, {})
            if not isinstance(child, dict):
                path = ".".join(keys[: depth + 1])
                raise JobError([f"{path}: is {child!r}, not a section; cannot set {keys[-1]}"])
            node = child
        node[keys[-1]] = _merged(node.get(keys[-1]), value)
    return data


def _merged(old: Any, new: Any) -> Any:
    """`new` merged into `old` where both are mappings (recursively), else `new`."""
    if not (isinstance(old, dict) and isinstance(new, dict)):
        return new
    return {**old, **{key: _merged(old.get(key), value) for key, value in new.items()}}


def _format_validation_error(error: ValidationError) -> list[str]:
    problems = []
    for item in error.errors():
        path = ".".join(str(part) for part in item["loc"]) or "job"
        message = item["msg"].removeprefix("Value error, ")
        if item["type"] == "missing":
            message = "missing (required)"
        elif item["type"] in ("extra_forbidden", "unexpected_keyword_argument"):
            message = "unknown key"
        elif item["loc"] == ("decoding",) and item["type"] == "value_error":
            key = DecodingSection.key_of(message)  # a check of the whole section
            path = f"decoding.{key}" if key else path
        elif "input" in item and item["type"] not in ("value_error",):
            message = f"{message} (got {item['input']!r})"
        names_its_key = not item["loc"] and _KEY_PREFIX.match(message)
        problems.append(message if names_its_key else f"{path}: {message}")
    return problems


_KEY_PREFIX = re.compile(r"[a-z_]+(\.[a-z_]+)+: ")  # job-level checks that name the key


def parse_job(data: Any) -> Job:
    """Schema validation only (no file system checks)."""
    if not isinstance(data, dict):
        raise JobError([f"job: expected a mapping of sections, got {type(data).__name__}"])
    try:
        return Job.model_validate(data)
    except ValidationError as error:
        raise JobError(_format_validation_error(error)) from error


def check_paths(job: Job) -> None:
    """Check that local inputs, models and drafters exist, a hub the replicas download from
    lists the model, and the output can be written, before any Ray starts."""
    problems = []
    where = job.input.path
    if where.is_local and not _glob_or_exists(where.resolved):
        problems.append(f"input.path: no such file, folder or glob: {where.text!r}")
    model = job.model.path
    try:
        model_dir = model.cached_checkpoint()
    except (ImportError, OSError, ValueError) as error:
        problems.append(f"model.path: cannot resolve {model.text!r}: {_reason(error)}")
        model_dir = None
    else:
        wrong = _model_problems(model, model_dir)
        problems += wrong
        model_dir = None if wrong else model_dir
    try:
        drafter_file = job.drafter_path()
        if drafter_file is not None and "://" not in drafter_file:
            if not os.path.isfile(drafter_file):
                raise FileNotFoundError(f"no such file: {drafter_file}")
            drafter_kind(job.drafter.kind).check_file(drafter_file)
    except (ImportError, OSError, ValueError) as error:
        problems.append(f"drafter.path: {_reason(error)}")
    if model_dir is not None and job.model.tensor_parallel > 1:
        from spot.models.tensor_parallel import degree_problems

        degree = job.model.tensor_parallel
        problems += [
            f"model.tensor_parallel: {problem}"
            for problem in degree_problems(str(model_dir), job.model.family, degree)
        ]
    if model_dir is not None and job.input.chat_template and not _has_chat_template(model_dir):
        problems.append(
            "input.chat_template: the model's tokenizer has no chat template; "
            "set input.chat_template: false"
        )
    if model_dir is not None:
        problems += _family_problems(job.model.family, model_dir)
        problems += _prefix_cache_problems(job, model_dir)
    problems += _output_problems(job.output.path)
    if job.drafter.learn and not job.output.path.is_local:
        problems.append(
            "drafter.learn: learned drafters are written under output.path, which must be a "
            f"folder the learner can write (local or shared), not {job.output.path.text!r}"
        )
    problems += _gpu_problems(job)
    if problems:
        raise JobError(problems)


def _model_problems(model: Location, model_dir: Path | None) -> list[str]:
    """A hub id this machine has not cached that the hub cannot give, or a local path that
    holds no checkpoint."""
    if model.kind == Kind.HUB and model_dir is None:
        unreachable = hub_problem(model.text)  # each replica downloads it: can they?
        return [f"model.path: {unreachable}"] if unreachable else []
    if model.kind != Kind.URI and not (model_dir and (model_dir / "config.json").is_file()):
        return [f"model.path: {model.text!r} is not a checkpoint directory (no config.json)"]
    return []


def checkpoint_family(model_dir: Path) -> tuple[Any, str | None]:
    """The model_type the checkpoint's config.json declares and the family that reads it
    (None when no known family does)."""
    config = json.loads((model_dir / "config.json").read_text())
    model_type = config.get("model_type") if isinstance(config, dict) else None
    return model_type, family_reading(model_type)


def _family_problems(family: str | None, model_dir: Path) -> list[str]:
    """model.family against the checkpoint's config.json (which names it when left out)."""
    try:
        model_type, found = checkpoint_family(model_dir)
    except (OSError, ValueError) as error:
        return [f"model.path: cannot read {model_dir / 'config.json'}: {error}"]
    if found is None and family is None:
        return [
            f"model.family: the checkpoint's config.json names no known family (model_type "
            f"{model_type!r}); set model.family: {_one_of(family_names())}"
        ]
    if found is not None and family is not None and family != found:
        return [
            f"model.family: {family} does not match the checkpoint, whose config.json "
            f"model_type {model_type!r} is the {found} family; set model.family: {found} "
            "or leave it out"
        ]
    return []


def _prefix_cache_problems(job: Job, model_dir: Path) -> list[str]:
    """A prefix cache asked (a size, not auto) of a target that cannot take one."""
    size = job.resources.prefix_cache_bytes
    if size == "auto" or size == 0:
        return []
    if job.model.tensor_parallel > 1:
        from spot.models.tensor_parallel import NO_PREFIX_CACHE

        return [f"resources.prefix_cache_bytes: {NO_PREFIX_CACHE}; set 0 or auto"]
    from spot.models.registry import families, prefix_cache_problem

    try:
        name = job.model.family or checkpoint_family(model_dir)[1]
    except (OSError, ValueError):
        return []  # _family_problems says why
    family = families().get(name) if name else None
    problem = family and prefix_cache_problem(family.block_causal)
    return [f"resources.prefix_cache_bytes: {problem}; set 0 or auto"] if problem else []


def _output_problems(where: Location) -> list[str]:
    """output.path must be a folder this process can write in, or a path one can be made
    at: checked by creating and removing a file there (permission bits alone would pass a
    read-only mount, and every folder for root). URIs are checked when written."""
    if not where.is_local:
        return []
    path, local = where.text, where.resolved
    if os.path.lexists(local) and not os.path.isdir(local):
        return [f"output.path: {path!r} is a file, not a folder"]
    existing = local
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        return [f"output.path: {path!r} cannot be a folder: {existing!r} is a file"]
    try:
        handle, probe = tempfile.mkstemp(dir=existing, prefix=".spot-write-check-")
        os.close(handle)
        os.remove(probe)
    except OSError as error:
        return [f"output.path: cannot write in {existing!r} ({error.strerror})"]
    return []


def _gpu_problems(job: Job) -> list[str]:
    """Tensor parallel ranks run on the replica's GPUs, or on CPU with num_gpus: 0 (how a
    machine without GPUs runs them); on a machine with GPUs, num_gpus: 0 is a forgotten key."""
    degree = job.model.tensor_parallel
    if degree == 1 or job.resources.num_gpus:
        return []
    import torch

    if not torch.cuda.is_available():
        return []
    return [
        f"model.tensor_parallel: {degree} ranks with resources.num_gpus: 0 would run on CPU "
        f"on this machine, which has GPUs; set resources.num_gpus: {degree} (one per rank)"
    ]


def _reason(error: Exception) -> str:
    if isinstance(error, ImportError):
        return f"cannot import {error.name}"
    return str(error.args[0]) if error.args else type(error).__name__


def _glob_or_exists(path: str) -> bool:
    if any(ch in path for ch in GLOB_CHARACTERS):
        import glob

        return bool(glob.glob(path, recursive=True))
    return os.path.exists(path)


def _has_chat_template(model_dir: Path) -> bool:
    if (model_dir / "chat_template.jinja").is_file():
        return True
    config = model_dir / "tokenizer_config.json"
    if not config.is_file():
        return False
    import json

    return bool(json.loads(config.read_text()).get("chat_template"))


def load_job(path: str | os.PathLike, overrides: Iterable[str] = ()) -> Job:
    """Read, override, validate and check a job file."""
    try:
        text = Path(path).read_text()
    except OSError as error:
        raise JobError([f"{path}: cannot read job file: {error.strerror}"]) from error
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise JobError([f"{path}: not valid YAML: {error}"]) from error
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise JobError([f"job: expected a mapping of sections, got {type(data).__name__}"])
    job = parse_job(apply_overrides(data, overrides))
    check_paths(job)
    return job
