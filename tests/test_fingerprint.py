"""What a job's fingerprint holds (what decides the tokens, nothing that only changes speed),
how a checkpoint's identity follows its files, and how an output is claimed."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.fingerprint import (
    FINGERPRINT_FILE,
    ResumeRefused,
    checkpoint_identity,
    claim_output,
    clearing_removes,
    differences,
    fingerprint,
)
from pipeline.inputs import plan_input
from pipeline.job import DecodingSection, parse_job
from spot.builtin import resolve_builtin
from tests.pipeline_fixtures import job_dict, write_prompts


def _job(root: Path, **sections):
    prompts = root / "prompts.parquet"
    if not prompts.exists():
        write_prompts(prompts, {"id": [1], "prompt": ["hi"]})
    return parse_job(job_dict(prompts, "builtin:sdar-nano", root / "out", **sections))


def test_what_decides_the_tokens_is_in_and_what_only_changes_speed_is_not(tmp_path: Path):
    keys = fingerprint(_job(tmp_path))
    assert {f"decoding.{f.name}" for f in dataclasses.fields(DecodingSection)} <= set(keys)
    assert {"model.path", "model.checkpoint", "model.family", "model.dtype"} <= set(keys)
    assert {"input.prompt_column", "input.chat_template", "input.system_prompt"} <= set(keys)
    assert not [k for k in keys if k.startswith(("drafter.", "resources.", "cost.", "output."))]
    assert "input.path" not in keys and "input.limit" not in keys
    assert keys["model.family"] == "sdar"  # read from the checkpoint when the job leaves it out
    faster = _job(
        tmp_path,
        drafter={"kind": "spot", "budget": 2},
        resources={"replicas": 2, "batch_size": 3},
        input={"limit": 1},
    )
    assert fingerprint(faster) == keys


def test_the_checkpoint_identity_follows_configs_tokenizer_and_weight_sizes(tmp_path: Path):
    model = tmp_path / "model"
    shutil.copytree(resolve_builtin("targets/sdar-nano"), model)
    before = checkpoint_identity(model)
    (model / "README.md").write_text("notes")  # not a checkpoint file
    assert checkpoint_identity(model) == before
    template = model / "tokenizer_config.json"
    template.write_text(template.read_text().replace("<|im_start|>", "<|im_begin|>"))
    changed = checkpoint_identity(model)
    assert changed != before
    with open(model / "model.safetensors", "ab") as weights:
        weights.write(b"\0")
    assert checkpoint_identity(model) != changed


def test_differences_name_each_key_and_skip_what_was_not_known():
    old = {"decoding.seed": 1, "model.checkpoint": None, "decoding.top_k": None}
    new = {"decoding.seed": 2, "model.checkpoint": "abc", "decoding.top_k": 50, "x.new": 1}
    assert differences(old, new) == ["decoding.seed: 1 -> 2", "decoding.top_k: null -> 50"]


def test_claiming_an_output(tmp_path: Path):
    job = _job(tmp_path)
    plan = plan_input(job.input)
    out = claim_output(job, plan)
    path = Path(out.root, FINGERPRINT_FILE)
    assert json.loads(path.read_text()) == fingerprint(job)
    other = _job(tmp_path, decoding={"temperature": 0.5})
    claim_output(other, plan)  # no rows yet: nothing to mix, the fingerprint is replaced
    assert json.loads(path.read_text())["decoding.temperature"] == 0.5
    data = Path(out.data)
    data.mkdir()
    (data / "part-x.parquet").write_bytes(b"rows")
    with pytest.raises(ResumeRefused) as refused:
        claim_output(job, plan)
    assert "  decoding.temperature: 0.5 -> 0.0" in refused.value.problems
    learned = Path(out.root, "drafter")  # a learning job's drafters go with its rows
    learned.mkdir()
    (learned / "rounds.json").write_text("{}")
    claim_output(job, plan, overwrite=True)
    assert not data.exists() and json.loads(path.read_text()) == fingerprint(job)
    assert not learned.exists()


def test_what_overwriting_removes_is_counted_before(tmp_path: Path):
    job = _job(tmp_path)
    assert clearing_removes(job) is None  # no folder yet
    out = claim_output(job, plan_input(job.input))
    assert clearing_removes(job) == "fingerprint.json"
    data = Path(out.data)
    data.mkdir()
    for name, rows in (("part-a.parquet", 3), ("part-b.parquet", 1)):
        pq.write_table(pa.table({"id": list(range(rows))}), data / name)
    (data / ".part-c.parquet.partial").write_bytes(b"half")  # not a part
    Path(out.summary).write_text(json.dumps({"runs": [{}, {}]}))
    Path(out.root, "report").mkdir()
    Path(out.root, "drafter").mkdir()
    Path(out.root, "logs").mkdir()
    assert clearing_removes(job) == (
        "2 part files (4 rows), summary.json (2 runs), report/, drafter/, fingerprint.json"
    )
    claim_output(job, plan_input(job.input), overwrite=True)
    assert clearing_removes(job) == "fingerprint.json"  # the new job's own
    assert Path(out.root, "logs").is_dir()
