"""The bundled targets ship with the package, load offline by name and answer a prompt."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from spot.builtin import builtin_targets, resolve_builtin
from spot.config import DecodingConfig
from spot.decode import Request, generate
from spot.models.loading import load_target
from spot_common.corpus import is_well_formed
from spot_common.tokenizer import load_tokenizer
from spot_factory.target_quality import completion_text
from spot_factory.tokenizer import chat_prompt

BUNDLED = {"sdar-tiny": "sdar", "sdar-nano": "sdar", "llada-tiny": "llada"}
PROMPT = {
    "kind": "math",
    "prompt": "Sam has 12 marbles. He finds 7 more. How many marbles does Sam have now?",
}


def test_every_bundled_target_is_listed_and_resolves():
    assert set(BUNDLED) <= set(builtin_targets())
    for name in BUNDLED:
        assert resolve_builtin(f"builtin:{name}") == resolve_builtin(name)
        assert (resolve_builtin(name) / "config.json").is_file()
    with pytest.raises(FileNotFoundError, match="sdar-tiny"):
        resolve_builtin("builtin:no-such-target")


@pytest.mark.parametrize("name", sorted(BUNDLED))
def test_checkpoint_is_in_the_family_format_and_small(name):
    path = resolve_builtin(name)
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == BUNDLED[name]
    weights = path / "model.safetensors"
    assert weights.stat().st_size < 8 * 2**20
    with safe_open(weights, framework="pt") as f:
        names = list(f.keys())  # noqa: SIM118 (safe_open has no __iter__)
        dtypes = {f.get_tensor(n).dtype for n in names[:3]}
    assert dtypes == {torch.bfloat16}
    prefix = "model.layers.0." if BUNDLED[name] == "sdar" else "model.transformer.blocks.0."
    assert any(n.startswith(prefix) for n in names)


@pytest.mark.parametrize("name", sorted(BUNDLED))
def test_bundled_target_answers_a_fixed_prompt_well_formed(name):
    path = resolve_builtin(name)
    tokenizer = load_tokenizer(path)
    target = load_target(path, dtype=torch.float32)
    ids = tokenizer.encode(chat_prompt(PROMPT["prompt"]), add_special_tokens=False)
    config = DecodingConfig(gen_length=64, block_length=32)
    (result,) = generate(target, [Request(torch.tensor(ids), 0)], config)
    text, _ = completion_text(tokenizer, result.tokens, target.eos_ids)
    assert result.finish_reason == "eos"
    assert is_well_formed(PROMPT, text), text
