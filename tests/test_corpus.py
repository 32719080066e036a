"""The bundled corpus and tokenizer: reproducible, split cleanly, loadable offline."""

from __future__ import annotations

import itertools
import json
import operator

import pytest
from transformers import AutoTokenizer

from spot.builtin import resolve_builtin
from spot_common import corpus
from spot_common.tokenizer import load_tokenizer
from spot_factory.tokenizer import CHAT_TEMPLATE, MASK, chat_prompt, train_tokenizer


def test_same_seed_same_text_other_seed_other_text():
    first = [corpus.example(7, i) for i in range(200)]
    again = [corpus.example(7, i) for i in range(200)]
    other = [corpus.example(8, i) for i in range(200)]
    assert first == again
    assert sum(a.prompt == b.prompt for a, b in zip(first, other)) < 20


def test_heldout_problems_never_appear_in_training_stream():
    heldout = list(itertools.islice(corpus.examples(0, "heldout"), 300))
    train = list(itertools.islice(corpus.examples(0, "train"), 6000))
    assert {e.key for e in heldout}.isdisjoint(e.key for e in train)
    assert {e.prompt for e in heldout}.isdisjoint(e.prompt for e in train)
    assert all(corpus.split_of(e.key) == "heldout" for e in heldout)


def test_every_kind_and_many_templates_appear():
    items = [corpus.example(0, i) for i in range(3000)]
    assert {e.kind for e in items} == {"math", "trace", "code", "record"}
    assert {e.template for e in items} == set(corpus.MATH_TEMPLATES) | set(corpus.OTHER_TEMPLATES)


_APPLY = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.floordiv}


def test_worked_solutions_are_right_and_graded_by_their_answer():
    for item in (corpus.example(3, i) for i in range(2000)):
        assert corpus.is_correct(item, item.completion)
        assert corpus.is_well_formed(item, item.completion)
        if item.kind not in ("math", "trace"):
            continue
        steps = corpus.STEP.findall(item.completion)
        assert steps
        for a, op, b, result in steps:
            assert _APPLY[op](int(a), int(b)) == int(result), item.completion
        assert steps[-1][3] == item.answer
        wrong = item.completion.rsplit("#### ", 1)[0] + "#### 1000"
        assert not corpus.is_correct(item, wrong)


def test_bundled_heldout_prompts_are_heldout():
    rows = corpus.read_jsonl(resolve_builtin("prompts/heldout.jsonl"))
    assert len(rows) >= 200 and sum(r["kind"] == "math" for r in rows) >= 200
    assert all(corpus.split_of(r["key"]) == "heldout" for r in rows)
    assert len({r["id"] for r in rows}) == len(rows)


@pytest.fixture(scope="module")
def bundled_tokenizer():
    return AutoTokenizer.from_pretrained(resolve_builtin("tokenizer"))


def test_tokenizer_round_trip_and_special_tokens(bundled_tokenizer):
    tok = bundled_tokenizer
    for item in (corpus.example(1, i) for i in range(300)):
        text = chat_prompt(item.prompt) + item.completion + "<|im_end|>"
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text
    assert tok.mask_token == MASK and tok.convert_tokens_to_ids(MASK) == tok.mask_token_id
    assert tok.eos_token == "<|endoftext|>"
    assert len({tok.mask_token_id, tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")}) == 3
    assert 1000 <= len(tok) <= 2048


def test_checkpoint_tokenizer_loads_without_reading_the_model_config(tmp_path, bundled_tokenizer):
    """A target directory's tokenizer comes from its tokenizer files alone: config.json names
    a model type transformers does not know, and reading it only produced warnings."""
    target = resolve_builtin("builtin:sdar-tiny")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (tmp_path / name).write_bytes((target / name).read_bytes())
    (tmp_path / "config.json").write_text("not a config")
    with pytest.raises(OSError):
        AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    text = chat_prompt("12 + 7 = ?")
    tokenizer = load_tokenizer(tmp_path)
    assert tokenizer(text).input_ids == bundled_tokenizer(text).input_ids
    assert tokenizer.mask_token == MASK and tokenizer.chat_template == CHAT_TEMPLATE


def test_small_numbers_are_single_tokens(bundled_tokenizer):
    for n in range(0, 97):
        assert len(bundled_tokenizer.encode(f" {n}", add_special_tokens=False)) == 1, n


def test_chat_template_renders_the_training_prompt(bundled_tokenizer):
    message = [{"role": "user", "content": "Ana has 3 pens."}]
    rendered = bundled_tokenizer.apply_chat_template(
        message, add_generation_prompt=True, tokenize=False
    )
    assert rendered == chat_prompt("Ana has 3 pens.")
    config = json.loads((resolve_builtin("tokenizer") / "tokenizer_config.json").read_text())
    assert config["chat_template"] == CHAT_TEMPLATE


def test_tokenizer_training_is_reproducible():
    a = train_tokenizer(seed=5, vocab_size=400, count=300)
    b = train_tokenizer(seed=5, vocab_size=400, count=300)
    assert a.to_str() == b.to_str()
    assert a.get_vocab_size() == 400
