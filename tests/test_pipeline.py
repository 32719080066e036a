"""End to end on a real local Ray: Parquet prompts in, corpus and per-sample stats out.

The output contract (columns, carried columns, one row per input row and sample, readers),
bad rows as error rows, the summary, and reproducibility across replicas and batch sizes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pyarrow.dataset as pds
import pytest

from pipeline.job import parse_job
from pipeline.runner import run_job
from pipeline.schema import GENERATED_FIELDS
from tests.pipeline_fixtures import (
    by_key,
    job_dict,
    local_ray,  # noqa: F401  (module fixture)
    make_tiny_sdar,
    read_output,
    word_prompts,
    write_prompts,
)

GOOD = 14


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pipeline")
    ids = [f"r{i}" for i in range(GOOD)] + ["null", "empty", "blank", "long", "dup", "dup", None]
    prompts = word_prompts(GOOD) + [None, "", "   ", "seven " * 400, "a", "b", "c"]
    prompts_file = write_prompts(
        root / "in" / "prompts.parquet",
        {"id": ids, "prompt": prompts, "source": [f"s{i}" for i in range(len(ids))]},
    )
    return {"root": root, "model": make_tiny_sdar(root / "model"), "prompts": prompts_file}


def _run(setup, name: str, temperature: float, replicas: int, batch_size: int, samples: int):
    out = setup["root"] / name
    job = parse_job(
        job_dict(
            setup["prompts"],
            setup["model"],
            out,
            decoding={"temperature": temperature, "samples_per_prompt": samples},
            resources={"replicas": replicas, "batch_size": batch_size},
            cost={"usd_per_replica_hour": 3.6},
        )
    )
    summary = run_job(job, echo=lambda line: None)
    return out, summary


@pytest.fixture(scope="module")
def sampled_one_replica(local_ray, setup):  # noqa: F811
    return _run(setup, "t08-r1-b8", 0.8, replicas=1, batch_size=8, samples=2)


def test_output_rows_columns_and_errors(sampled_one_replica):
    out, summary = sampled_one_replica
    table = read_output(out)
    names = table.column_names
    assert names[:2] == ["id", "prompt"]
    assert {f.name for f in GENERATED_FIELDS} | {"sample_index", "source"} <= set(names)
    rows = table.to_pylist()
    assert len(rows) == (GOOD + 7) * 2  # one row per input row and sample, bad rows included
    keys = {(r["id"], r["sample_index"]) for r in rows if r["id"] != "dup"}
    assert len(keys) == len(rows) - 4  # every key once; the two "dup" rows both come back

    good = [r for r in rows if r["error"] is None]
    assert {r["id"] for r in good} == {f"r{i}" for i in range(GOOD)}
    for r in good:
        assert r["completion_token_ids"] and r["num_generated_tokens"] == len(
            r["completion_token_ids"]
        )
        assert isinstance(r["completion"], str)
        assert r["nfe"] >= 1 and r["steps"] >= r["nfe"]
        assert r["accepted_steps_per_forward"] == pytest.approx(r["steps"] / r["nfe"])
        assert r["finish_reason"] in ("eos", "length") and r["seed"] == 1
        assert r["model"] == str(out.parent / "model") and r["drafter"] == "none"
        assert r["source"] == f"s{int(r['id'][1:])}"  # carried through unchanged
    a, b = (
        {r["sample_index"]: r["completion_token_ids"] for r in good if r["id"] == "r0"}[s]
        for s in (0, 1)
    )
    assert a != b  # each sample has its own noise key

    errors = {(r["id"], r["error"].split(":")[0]) for r in rows if r["error"] is not None}
    assert errors == {
        ("null", "prompt is null"),
        ("empty", "prompt is empty"),
        ("blank", "prompt is empty"),
        ("long", "prompt too long"),
        ("dup", "duplicate id"),
        (None, "id is null"),
    }
    for r in rows:
        if r["error"] is not None:
            assert r["completion"] is None and r["completion_token_ids"] is None
            assert r["finish_reason"] == "error"

    totals = summary["totals"]
    assert totals["rows"] == len(rows) and totals["errors"] == 14
    assert totals["generated_tokens"] == sum(r["num_generated_tokens"] for r in good)
    assert totals["steps_per_nfe"] == pytest.approx(
        sum(r["steps"] for r in good) / sum(r["nfe"] for r in good)
    )
    assert summary["replica_hours"] == pytest.approx(summary["wall_seconds"] / 3600)
    assert summary["cost_usd"] == pytest.approx(summary["replica_hours"] * 3.6)
    assert summary["usd_per_million_tokens"] == pytest.approx(
        summary["cost_usd"] / totals["generated_tokens"] * 1e6
    )
    assert summary["versions"]["ray"] and summary["job"]["name"] == "test"
    assert json.loads((out / "summary.json").read_text()) == summary


def test_output_is_readable_by_pyarrow_pandas_and_datasets(sampled_one_replica, tmp_path):
    import datasets

    out, summary = sampled_one_replica
    rows = summary["totals"]["rows"]
    assert pds.dataset(out / "data", format="parquet").count_rows() == rows
    frame = pd.read_parquet(out / "data")
    assert len(frame) == rows and frame["completion_token_ids"].notna().sum() == GOOD * 2
    loaded = datasets.load_dataset(
        "parquet", data_dir=str(out / "data"), split="train", cache_dir=str(tmp_path)
    )
    assert loaded.num_rows == rows and "completion" in loaded.column_names


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_same_completions_whatever_replicas_and_batch_size(request, setup, temperature):
    columns = ("completion_token_ids", "nfe", "steps", "error")
    if temperature == 0.8:
        one, _ = request.getfixturevalue("sampled_one_replica")
    else:
        request.getfixturevalue("local_ray")
        one, _ = _run(setup, "t0-r1-b8", temperature, 1, 8, samples=2)
    two, _ = _run(setup, f"t{temperature}-r2-b3", temperature, 2, 3, samples=2)
    a = by_key(read_output(one).filter(pds.field("id") != "dup"), *columns)
    b = by_key(read_output(two).filter(pds.field("id") != "dup"), *columns)
    assert a == b
    assert len([v for v in a.values() if v[0] is not None]) == GOOD * 2
