"""The job schema: every shipped job validates, bad jobs are rejected naming the key,
overrides are typed, and the decoding section converts to the core's DecodingConfig."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow as pa
import pytest
import yaml
from click.testing import CliRunner
from pydantic import TypeAdapter

from pipeline.cli import main
from pipeline.inputs import output_names, plan_input
from pipeline.job import DecodingSection, JobError, apply_overrides, load_job, parse_job
from pipeline.locations import Kind, Location
from spot.builtin import resolve_builtin
from spot.config import CommitRule, DecodingConfig
from spot.models.hub import is_hub_id
from tests.pipeline_fixtures import job_dict, make_tiny_sdar, write_prompts

JOBS = sorted((Path(__file__).resolve().parents[1] / "jobs").glob("*.yaml"))


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("job")
    model = make_tiny_sdar(root / "model")
    prompts = write_prompts(
        root / "in" / "p.parquet",
        {"id": ["a", "b", "a"], "prompt": ["12", "34", "56"], "completion": ["x", "y", "z"]},
    )
    return {"root": root, "model": model, "prompts": prompts}


def _write(root: Path, data: dict, name: str = "job.yaml") -> Path:
    path = root / name
    path.write_text(yaml.safe_dump(data))
    return path


def _problems(path: Path, overrides=()) -> list[str]:
    with pytest.raises(JobError) as caught:
        load_job(path, overrides)
    return caught.value.problems


@pytest.mark.parametrize("job_file", JOBS, ids=[p.name for p in JOBS])
def test_every_shipped_job_validates(job_file: Path):
    first_line = job_file.read_text().splitlines()[0]
    assert first_line.startswith("# ") and "spot-pipeline submit" in first_line
    job = load_job(job_file)
    assert plan_input(job.input).num_rows > 0


def test_shipped_jobs_exist():
    assert [p.name for p in JOBS if p.name == "synthetic.yaml"] == ["synthetic.yaml"]


def test_the_quick_start_job_takes_the_drafters_its_comment_offers(tmp_path):
    """jobs/synthetic.yaml decodes draft-free with threshold decoding; the drafters its comment
    offers for that rule validate through the CLI, SPOT (static rule only) is refused naming
    the key, and with `decoding.rule=static` SPOT validates (the README's table)."""
    job = next(p for p in JOBS if p.name == "synthetic.yaml")
    shipped = load_job(job)
    assert shipped.drafter.kind == "none" and shipped.decoding.rule is CommitRule.THRESHOLD

    def validate(*overrides: str):
        args = ["validate", str(job), "--set", f"output.path={tmp_path / 'out'}"]
        for override in overrides:
            args += ["--set", override]
        return CliRunner().invoke(main, args)

    for kind in ("spot-sets", "spiffy"):
        result = validate(f"drafter.kind={kind}")
        assert result.exit_code == 0, result.output
    refused = validate("drafter.kind=spot")
    assert refused.exit_code == 2
    assert "drafter.kind: spot drafts for the static rule, not decoding.rule" in refused.output
    result = validate("decoding.rule=static", "drafter.kind=spot")
    assert result.exit_code == 0, result.output


def test_valid_job_round_trips(files):
    data = job_dict(files["prompts"], files["model"], files["root"] / "out")
    job = load_job(_write(files["root"], data))
    assert job.decoding.gen_length == 16 and job.drafter.kind == "none"
    assert parse_job(yaml.safe_load(job.to_yaml())) == job


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"decoding": {"block_lenght": 4}}, "decoding.block_lenght: unknown key"),
        ({"resources": {"batch_size": "eight"}}, "resources.batch_size: "),
        ({"decoding": {"temperature": -1}}, "decoding.temperature: "),
        (
            {"decoding": {"block_length": 5}},
            "decoding.gen_length: gen_length (16) must be a multiple of block_length (5)",
        ),
        (
            {"decoding": {"tokens_per_step": 3}},
            "decoding.tokens_per_step: tokens_per_step (3) must divide block_length (4)",
        ),
        ({"decoding": {"seed": -1}}, "decoding.seed: seed must be >= 0"),
        ({"decoding": {"stop": ["", "x"]}}, "decoding.stop: stop strings must not be empty"),
        ({"decoding": {"samples_per_prompt": 0}}, "decoding.samples_per_prompt: "),
        (
            {"model": {"family": "gpt"}},
            "model.family: unknown family 'gpt'; one of dream, llada, llada2 or sdar",
        ),
        ({"decoding": {"rule": "greedy"}}, "decoding.rule: "),
        ({"model": {"dtype": "float16"}}, "model.dtype: "),
        ({"model": {"tensor_parallel": 0}}, "model.tensor_parallel: "),
        ({"drafter": {"kind": "medusa"}}, "drafter.kind: "),
        ({"drafter": {"kind": "spot"}}, "drafter.path: required unless the target is bundled"),
        ({"drafter": {"kind": "spot", "path": "/no/such.safetensors"}}, "drafter.path: no such"),
        ({"drafter": {"budget": 0}}, "drafter.budget: "),
        ({"drafter": {"kind": "spot-sets"}}, "drafter.kind: spot-sets drafts for the threshold"),
        (
            {"drafter": {"kind": "spot"}, "decoding": {"rule": "threshold"}},
            "drafter.kind: spot drafts for the static rule, not decoding.rule 'threshold'; "
            "use drafter.kind spiffy or spot-sets",
        ),
        (
            {"drafter": {"kind": "spiffy", "budget": 8}, "decoding": {"tokens_per_step": 2}},
            "drafter.kind: spiffy drafts one token per step",
        ),
    ],
)
def test_bad_values_name_their_key(files, change, expected):
    data = job_dict(files["prompts"], files["model"], files["root"] / "out", **change)
    problems = _problems(_write(files["root"], data))
    assert any(p.startswith(expected) for p in problems), problems


def test_unknown_top_level_key_is_named(files):
    data = job_dict(files["prompts"], files["model"], files["root"] / "out")
    data["colour"] = "blue"
    assert _problems(_write(files["root"], data)) == ["colour: unknown key"]


def test_missing_sections_and_paths_are_named(files):
    data = job_dict(files["prompts"], files["model"], files["root"] / "out")
    del data["input"]
    assert "input: missing (required)" in _problems(_write(files["root"], data))

    data = job_dict(files["root"] / "nowhere.parquet", files["model"], files["root"] / "out")
    [problem] = _problems(_write(files["root"], data))
    assert problem.startswith("input.path: no such file")

    data = job_dict(files["prompts"], files["root"], files["root"] / "out")
    [problem] = _problems(_write(files["root"], data))
    assert problem.startswith("model.path: ") and "config.json" in problem


def test_unknown_builtin_is_named(files):
    data = job_dict("builtin:no-such-target", "builtin:no-such-target", files["root"] / "out")
    problems = _problems(_write(files["root"], data))
    assert any(
        p.startswith("model.path: cannot resolve 'builtin:no-such-target'") for p in problems
    )
    assert any(p.startswith("input.path: cannot resolve") for p in problems)


def test_chat_template_needs_a_template(files):
    plain = files["root"] / "plain-model"
    shutil.copytree(files["model"], plain)
    (plain / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((plain / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (plain / "tokenizer_config.json").write_text(json.dumps(config))
    data = job_dict(files["prompts"], plain, files["root"] / "out")
    [problem] = _problems(_write(files["root"], data))
    assert problem.startswith("input.chat_template: ")
    data["input"]["chat_template"] = False
    assert load_job(_write(files["root"], data)).input.chat_template is False


def test_overrides_are_yaml_values_and_checked(files):
    path = _write(files["root"], job_dict(files["prompts"], files["model"], files["root"] / "o"))
    job = load_job(
        path,
        [
            "decoding.temperature=0.7",
            "decoding.top_k=null",
            "resources.replicas=2",
            "input.chat_template=false",
            "cost.usd_per_replica_hour=2.5",
            "drafter.budget=auto",
        ],
    )
    assert job.decoding.temperature == 0.7 and job.resources.replicas == 2
    assert job.cost.usd_per_replica_hour == 2.5 and job.drafter.budget == "auto"
    assert _problems(path, ["decoding.tempreature=0.5"]) == ["decoding.tempreature: unknown key"]
    assert _problems(path, ["name.first=x"])[0].startswith("name: is 'test', not a section")
    assert _problems(path, ["decoding"])[0].startswith("--set decoding: expected key.path=value")
    assert _problems(path, ["decoding.seed=[1, 2]"]) == [
        "decoding.seed: Input should be a valid integer (got [1, 2])"
    ]
    assert _problems(path, ["decoding.seed=[1, 2"]) == [
        "decoding.seed: --set cannot parse '[1, 2' as YAML: expected ',' or ']', but got "
        "'<stream end>' at column 6"
    ]
    assert _problems(path, ["decoding.stop=[1]"]) == [
        "decoding.stop.0: Input should be a valid string (got 1)"
    ]


def test_overrides_set_lists_mappings_and_text_yaml_reads_as_a_comment(files):
    path = _write(files["root"], job_dict(files["prompts"], files["model"], files["root"] / "o"))
    job = load_job(
        path,
        [
            'decoding.stop=["####", "Q: "]',
            "resources={replicas: 2, batch_size: 3}",
            "decoding.top_p=null",
        ],
    )
    assert job.decoding.stop == ("####", "Q: ") and job.decoding.top_p is None
    assert (job.resources.replicas, job.resources.batch_size) == (2, 3)
    assert job.resources.num_cpus == 0.5  # a mapping merges into the section
    assert load_job(path, ["decoding.stop=####"]).decoding.stop == ("####",)
    assert load_job(path, ["name=#1"]).name == "#1"
    assert _problems(path, ["resources={replicas: 2, batch_sze: 3}"]) == [
        "resources.batch_sze: unknown key"
    ]


@pytest.mark.parametrize(
    ("decoding", "names"),
    [
        ({"samples_per_prompt": 3}, "with decoding.temperature 0 (greedy)"),
        (
            {"samples_per_prompt": 2, "temperature": 0.8, "top_k": 1},
            "with decoding.top_k 1 (greedy at any decoding.temperature)",
        ),
    ],
)
def test_several_samples_of_a_greedy_decoding_are_refused(files, decoding, names):
    data = job_dict(files["prompts"], files["model"], files["root"] / "o", decoding=decoding)
    [problem] = _problems(_write(files["root"], data))
    assert problem.startswith("decoding.samples_per_prompt: samples_per_prompt ")
    assert names in problem and problem.endswith("or decoding.samples_per_prompt: 1")
    sampled = {**decoding, "temperature": 0.8, "top_k": 2}
    data = job_dict(files["prompts"], files["model"], files["root"] / "o", decoding=sampled)
    assert load_job(_write(files["root"], data)).decoding.samples_per_prompt > 1


def test_overrides_leave_the_original_untouched():
    data = {"decoding": {"seed": 1}}
    assert apply_overrides(data, ["decoding.seed=2"]) == {"decoding": {"seed": 2}}
    assert data == {"decoding": {"seed": 1}}


def test_decoding_section_converts_to_the_core_config(files):
    data = job_dict(
        files["prompts"],
        files["model"],
        files["root"] / "out",
        decoding={"rule": "threshold", "threshold": 0.8, "temperature": 0.5, "top_p": 0.9},
    )
    job = load_job(_write(files["root"], data))
    assert job.decoding_config() == DecodingConfig(
        gen_length=16,
        block_length=4,
        rule="threshold",
        threshold=0.8,
        temperature=0.5,
        top_p=0.9,
        seed=1,
    )


def test_decoding_defaults_are_the_core_configs():
    """One set of defaults: a job that names no decoding key decodes with DecodingConfig()'s,
    and the YAML keeps the rule's plain name."""
    section = DecodingSection()
    assert section.to_config() == DecodingConfig()
    assert TypeAdapter(DecodingSection).dump_python(section, mode="json")["rule"] == "static"
    assert DecodingSection(rule="sdar_dynamic").rule is CommitRule.SDAR_DYNAMIC


def test_paths_builtins_and_hub_ids_resolve_one_way(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert Location.parse("builtin:sdar-tiny").resolved == str(resolve_builtin("sdar-tiny"))
    assert Location.parse("s3://bucket/prompts").resolved == "s3://bucket/prompts"
    assert Location.parse("in/../p.parquet").resolved == str(tmp_path / "p.parquet")
    assert is_hub_id("org/model") and not is_hub_id("./org/model")
    assert not is_hub_id("/abs/model") and not is_hub_id("org/") and not is_hub_id("a/b/c")
    assert Location.parse("org/model").kind == Kind.LOCAL  # only a model path is a hub id
    (tmp_path / "org" / "model").mkdir(parents=True)  # a local directory wins over the hub
    local = Location.parse("org/model", hub_id=True)
    assert local.cached_checkpoint() == tmp_path / "org" / "model"
    assert local.portable == str(tmp_path / "org" / "model")
    # a hub id in no local cache stays an id: each replica downloads it
    remote = Location.parse("no-such-org/no-such-model", hub_id=True)
    assert remote.kind == Kind.HUB and remote.cached_checkpoint() is None
    assert remote.portable == "no-such-org/no-such-model"
    # every job path is one of these, written back as the user wrote it
    job = job_dict("in/../p.parquet", "org/model", "builtin:prompts")
    dumped = parse_job(job).model_dump(mode="json")
    assert [dumped[key]["path"] for key in ("input", "model", "output")] == [
        "in/../p.parquet",
        "org/model",
        "builtin:prompts",
    ]


def test_input_plan_checks_columns_and_finds_duplicates(files):
    data = job_dict(files["prompts"], files["model"], files["root"] / "out")
    job = load_job(_write(files["root"], data))
    plan = plan_input(job.input)
    assert plan.num_rows == 3 and plan.format == "parquet"
    assert plan.duplicate_ids.to_pylist() == [{"key": "a", "count": 2}]
    renamed = output_names(plan.schema.names, job.input)
    assert renamed == {"id": "id", "prompt": "prompt", "completion": "input_completion"}

    bad = job.input.model_copy(update={"prompt_column": "question"})
    with pytest.raises(JobError) as caught:
        plan_input(bad)
    assert caught.value.problems[0].startswith("input.prompt_column: no column 'question'")


def test_input_can_be_json_lines_or_a_glob(files):
    root = files["root"] / "jsonl"
    root.mkdir()
    (root / "a.jsonl").write_text('{"key": 1, "text": "12"}\n{"key": 2, "text": "3"}\n')
    (root / "b.jsonl").write_text('{"key": 3, "text": "45"}\n')
    data = job_dict(root, files["model"], files["root"] / "out")
    data["input"].update({"id_column": "key", "prompt_column": "text"})
    plan = plan_input(load_job(_write(files["root"], data)).input)
    assert plan.format == "json" and plan.num_rows == 3 and len(plan.files) == 2
    data["input"]["path"] = str(root / "*.jsonl")
    data["input"]["limit"] = 2
    plan = plan_input(load_job(_write(files["root"], data)).input)
    # JSON Lines ids are text
    assert plan.num_rows == 2 and plan.limited.column("key").to_pylist() == ["1", "2"]
    assert isinstance(plan.limited, pa.Table)


def test_a_learner_with_gpus_trains_on_its_gpu():
    from pipeline.job import LearningConfig

    assert LearningConfig().learner_config().device == "cpu"
    gpu = LearningConfig(num_gpus=0.25, epochs=2).learner_config()
    assert (gpu.device, gpu.epochs) == ("cuda", 2)
