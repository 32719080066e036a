"""The engine's three steps without Ray (tokenize, generate, detokenize): rows to requests and
back, row-level errors, continuous batching at any batch size, stop strings in the decode
loop, and the link to the decoding core (a row's completion is `generate` on its tokens and
noise key)."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest
import torch

from pipeline.engine import Engine, StopStrings
from pipeline.job import parse_job
from pipeline.prompts import cut_at_stop, find_stop
from pipeline.schema import GENERATED_FIELDS, PROMPT_IDS, ROW_ERROR
from pipeline.text import tokenize_rows
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
        assert rows[name]["error_kind"] == "input"
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


def _variant(engine: Engine, **sections) -> Engine:
    """An engine of the same model and job with some sections changed."""
    data = engine.job.model_dump()
    for key, value in sections.items():
        data[key] = {**data[key], **value}
    return Engine(parse_job(data))


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_same_rows_whatever_the_batch_size(engine: Engine, temperature: float):
    """Twelve rows through the engine decoding 1, 3 or 8 requests at once (continuously):
    every row as each request decoded alone gives it; with several at once, more than one
    request per forward."""
    batch = _batch([f"c{i}" for i in range(12)], word_prompts(12))
    compared = ("completion_token_ids", "completion", "nfe", "steps", "finish_reason")
    outputs = {}
    for size in (1, 3, 8):
        variant = _variant(
            engine, resources={"batch_size": size}, decoding={"temperature": temperature}
        )
        out = variant.process(batch)
        outputs[size] = [tuple(r[c] for c in compared) for r in out.to_pylist()]
        nfe, shares = (out.column(c).to_pylist() for c in ("nfe", "forward_share"))
        requests_per_forward = sum(nfe) / sum(shares)
        assert requests_per_forward == pytest.approx(1.0) or size > 1
        assert 1.5 < requests_per_forward <= size + 1e-9 or size == 1
    assert outputs[1] == outputs[3] == outputs[8]
    first = outputs[1][0]
    request = Request(torch.tensor(engine.encode(word_prompts(1)[0])), noise.request_key("c0", 0))
    [alone] = generate(engine.target, [request], variant.config)
    assert first[2] == alone.stats.nfe and first[4] == alone.finish_reason


def test_job_path_of_the_model_is_recorded(engine: Engine):
    out = engine.process(_batch(["m"], word_prompts(1))).to_pylist()[0]
    assert out["model"] == engine.job.model.path.text and out["drafter"] == "none"
    assert out["seed"] == engine.config.seed


def _untrained_spot(folder) -> Path:
    """A SPOT drafter file of an untrained order model (poor guesses, still lossless)."""
    from spot.drafters.files import save_order_model
    from spot.drafters.order_model import OrderModel, OrderModelConfig

    torch.manual_seed(0)
    path = folder / "spot.safetensors"
    model = OrderModel(OrderModelConfig(d_model=32, num_layers=1, num_heads=4, ff_size=64))
    save_order_model(path, model, "spot", {})
    return path


def test_a_drafter_changes_the_forwards_not_the_completions(engine: Engine, tmp_path):
    """The engine with a SPOT drafter (an untrained order model: poor guesses, still
    lossless) writes the draft-free completions, verifying more than one state per forward."""
    drafter_file = _untrained_spot(tmp_path)
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


def _stopping_engines(engine: Engine, tmp_path) -> tuple[list[Engine], list[str]]:
    """A stop string that occurs early in the first row's completion, blocks before its end
    (the text of two of its tokens), and the engines without and with it, draft-free and with a
    SPOT drafter."""
    drafter_file = _untrained_spot(tmp_path)
    block = engine.config.block_length
    [row] = engine.process(_batch(["s0"], word_prompts(1))).to_pylist()
    ids = row["completion_token_ids"]
    assert row["finish_reason"] == "length" and len(ids) > 3 * block
    stop = engine.tokenizer.decode(ids[block + 1 : block + 3], skip_special_tokens=True)
    assert stop.strip() and find_stop(row["completion"], [stop]) is not None
    drafter = {"kind": "spot", "path": str(drafter_file), "budget": 4}
    engines = [
        _variant(engine, decoding=decoding, drafter=drafted)
        for drafted in ({"kind": "none"}, drafter)
        for decoding in ({"stop": []}, {"stop": [stop]})
    ]
    return engines, [stop]


def test_stop_strings_end_decoding_after_their_block(engine: Engine, tmp_path):
    """With a stop string, each completion is the one without it cut at the first stop
    string (text, ids, count), and a request whose stop string comes before its last block
    stops decoding after that block: fewer forwards. Draft-free and with a drafter."""
    engines, stops = _stopping_engines(engine, tmp_path)
    batch = _batch([f"s{i}" for i in range(6)], word_prompts(6))
    for plain, stopping in (engines[:2], engines[2:]):
        unstopped = plain.process(batch).to_pylist()
        stopped = stopping.process(batch).to_pylist()
        for before, after in zip(unstopped, stopped, strict=True):
            ids, text, cut = cut_at_stop(engine.tokenizer, before["completion_token_ids"], stops)
            assert after["completion_token_ids"] == ids and after["completion"] == text
            assert after["num_generated_tokens"] == len(ids)
            assert after["finish_reason"] == ("stop" if cut else before["finish_reason"])
            assert after["nfe"] <= before["nfe"] and after["steps"] <= before["steps"]
        assert stopped[0]["finish_reason"] == "stop"
        assert stopped[0]["nfe"] < unstopped[0]["nfe"]


def test_the_stop_check_fires_at_the_first_block_whose_text_holds_a_stop(engine: Engine):
    """StopStrings, decoding only the new block and a little before it, says stop exactly
    when the text of all the ids so far holds a stop string: for stop strings inside a
    block, across a block boundary, longer than a block, and absent."""
    text = "Ella has 12 apples. She gives 5 to Max, who eats 3 of them.\n#### 7 apples left."
    ids = engine.tokenizer(text)["input_ids"]
    for stops in (["gives"], ["5 to Max, who"], ["who eats 3 of them.\n####"], ["\N{SNOWMAN}"]):
        for block in (1, 3, 4):
            check = StopStrings(engine.tokenizer, stops)
            fired = None
            for end in range(block, len(ids) + block, block):
                if check(torch.tensor(ids[:end])):
                    fired = end
                    break
            ends = range(block, len(ids) + block, block)
            holds = [
                e for e in ends if find_stop(engine.tokenizer.decode(ids[:e]), stops) is not None
            ]
            assert fired == (holds[0] if holds else None), (stops, block)
        again = StopStrings(engine.tokenizer, stops)  # a request decoded again from its start
        assert [again(torch.tensor(ids[:e])) for e in (len(ids), 4, len(ids))][1:] == [
            find_stop(engine.tokenizer.decode(ids[:4]), stops) is not None,
            stops != ["\N{SNOWMAN}"],
        ]


def test_tokenize_errors_pass_the_model_step_untouched(engine: Engine):
    """Rows the tokenize step marks carry their error through the model step; the model
    step receives ids only (no prompt text is read there)."""
    batch = _batch(["ok", "empty"], [word_prompts(1)[0], ""])
    tokenized = tokenize_rows(engine.tokenizer, engine.job.input, batch)
    assert tokenized.column(ROW_ERROR).to_pylist() == [None, "prompt is empty"]
    assert tokenized.column(PROMPT_IDS).to_pylist()[0] == engine.encode(word_prompts(1)[0])
    no_text = tokenized.set_column(1, "prompt", pa.array([None, None], pa.string()))
    rows = engine.generate_rows(no_text).to_pylist()
    assert rows[0]["error"] is None and rows[0]["completion_token_ids"]
    assert rows[1]["error"] == "prompt is empty" and rows[1]["nfe"] is None
    assert {PROMPT_IDS, ROW_ERROR}.isdisjoint(rows[0])
