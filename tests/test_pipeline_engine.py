"""The replica's engine without Ray: rows to requests and back, row-level errors, and the
link to the decoding core (a row's completion is `generate` on its tokens and noise key)."""

from __future__ import annotations

import pyarrow as pa
import pytest
import torch

from pipeline.engine import Engine
from pipeline.job import parse_job
from pipeline.schema import GENERATED_FIELDS, ROW_ERROR
from spot import noise
from spot.decode import Request, generate
from tests.pipeline_fixtures import job_dict, make_tiny_sdar, word_prompts, write_prompts


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> Engine:
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("engine")
    model = make_tiny_sdar(root / "model")
    prompts = write_prompts(root / "p.parquet", {"id": ["a"], "prompt": ["x"]})
    job = job_dict(prompts, model, root / "out", decoding={"temperature": 0.7})
    return Engine(parse_job(job))


def _batch(ids: list, prompts: pa.Array | list, extra: dict | None = None) -> pa.Table:
    n = len(ids)
    columns = {
        "id": ids,
        "prompt": prompts,
        "sample_index": pa.array([0] * n, pa.int64()),
        ROW_ERROR: pa.array([None] * n, pa.string()),
    }
    return pa.table({**columns, **(extra or {})})


def test_completion_is_the_core_decoding_of_the_row(engine: Engine):
    [prompt] = word_prompts(1)
    out = engine.process(_batch(["q1"], [prompt], {"topic": ["sums"]})).to_pylist()[0]
    ids = engine.encode(prompt)  # the prompt as a user turn of the chat template
    assert engine.tokenizer.decode(ids).startswith("<|im_start|>user\n" + prompt)
    request = Request(torch.tensor(ids), noise.request_key("q1", 0))
    [result] = generate(engine.target, [request], engine.config)
    tokens = result.tokens.tolist()
    eos = [i for i, t in enumerate(tokens) if t in engine.target.eos_ids]
    expected = tokens[: eos[0] + 1] if eos else tokens
    assert out["completion_token_ids"] == expected
    assert out["completion"] == engine.tokenizer.decode(expected, skip_special_tokens=True)
    assert out["num_prompt_tokens"] == len(ids) and out["nfe"] == result.stats.nfe
    assert out["steps"] == result.stats.steps and out["finish_reason"] == result.finish_reason
    assert out["topic"] == "sums" and out["error"] is None


def test_bad_rows_become_error_rows(engine: Engine):
    good = word_prompts(2)
    ids = ["ok1", "null", "empty", "blank", "long", "ok2", "marked"]
    prompts = [good[0], None, "", "  \n", "seven " * 400, good[1], good[0]]
    batch = _batch(ids, prompts)
    errors = pa.array([None] * 6 + ["duplicate id: appears 2 times in the input"], pa.string())
    batch = batch.set_column(batch.schema.get_field_index(ROW_ERROR), ROW_ERROR, errors)
    rows = {r["id"]: r for r in engine.process(batch).to_pylist()}
    assert rows["null"]["error"] == "prompt is null"
    assert rows["empty"]["error"] == rows["blank"]["error"] == "prompt is empty"
    assert rows["long"]["error"].startswith("prompt too long:")
    assert rows["marked"]["error"].startswith("duplicate id")
    for name in ("null", "empty", "blank", "long", "marked"):
        assert rows[name]["completion"] is None and rows[name]["finish_reason"] == "error"
    assert rows["ok1"]["error"] is None and rows["ok2"]["error"] is None
    assert rows["ok1"]["completion_token_ids"] and rows["ok2"]["completion_token_ids"]


def test_non_string_prompts_are_error_rows(engine: Engine):
    table = engine.process(_batch(["n1", "n2"], pa.array([7, 8], pa.int64())))
    assert table.column("error").to_pylist() == ["prompt is not a string (int)"] * 2
    assert table.column("prompt").to_pylist() == [None, None]
    assert table.schema.field("prompt").type == pa.string()


def test_output_schema_is_fixed(engine: Engine):
    errors_only = engine.process(_batch(["e"], pa.array([None], pa.string())))
    normal = engine.process(_batch(["g"], word_prompts(1)))
    for field in GENERATED_FIELDS:
        assert errors_only.schema.field(field.name) == field
        assert normal.schema.field(field.name) == field
    assert errors_only.schema == normal.schema


def test_a_failing_batch_is_retried_row_by_row(engine: Engine):
    """A request that breaks the batched forward (here: a token id outside the vocabulary)
    costs only its own row."""
    good = [Request(torch.tensor(engine.encode(p)), i) for i, p in enumerate(word_prompts(2))]
    broken = Request(torch.tensor([engine.target.vocab_size + 5] * 6), 99)
    results = engine._generate([good[0], broken, good[1]])
    assert results[1].startswith("generation failed: ")
    alone = generate(engine.target, good, engine.config)
    assert [r.tokens.tolist() for r in (results[0], results[2])] == [
        r.tokens.tolist() for r in alone
    ]


def test_job_path_of_the_model_is_recorded(engine: Engine):
    out = engine.process(_batch(["m"], word_prompts(1))).to_pylist()[0]
    assert out["model"] == engine.job.model.path and out["drafter"] == "none"
    assert out["seed"] == engine.config.seed


def test_a_drafter_changes_the_forwards_not_the_completions(engine: Engine, tmp_path):
    """The engine with a SPOT drafter (an untrained order model: poor guesses, still
    lossless) writes the draft-free completions, verifying more than one state per forward."""
    from spot.drafters.files import save_order_model
    from spot.drafters.order_model import OrderModel, OrderModelConfig

    torch.manual_seed(0)
    drafter_file = tmp_path / "spot.safetensors"
    model = OrderModel(OrderModelConfig(d_model=32, num_layers=1, num_heads=4, ff_size=64))
    save_order_model(drafter_file, model, "spot", {})
    data = engine.job.model_dump()
    data["drafter"] = {"kind": "spot", "path": str(drafter_file), "budget": 6}
    drafted = Engine(parse_job(data))
    assert drafted.drafter is not None and drafted.drafter_label.startswith("spot:")
    batch = _batch([f"d{i}" for i in range(3)], word_prompts(3))
    plain_rows = engine.process(batch).to_pylist()
    drafted_rows = drafted.process(batch).to_pylist()
    for plain, spec in zip(plain_rows, drafted_rows):
        assert spec["completion_token_ids"] == plain["completion_token_ids"]
        assert spec["steps"] == plain["steps"] and spec["nfe"] <= plain["nfe"]
        assert spec["tree_nodes_verified"] > spec["nfe"] and spec["drafter_seconds"] > 0
        assert spec["drafter"] == f"spot:{drafter_file}"
