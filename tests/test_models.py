"""Native architectures and checkpoints: original-format round trips, attention regimes, and
the real checkpoints' parameter lists mapped onto native parameters on the meta device."""

from __future__ import annotations

import json
import re

import pytest
import torch

from spot.models.llada import LLADA_FAMILY
from spot.models.loading import load_model, load_target, original_shapes, save_checkpoint
from spot.models.registry import family_for
from spot.models.sdar import SDAR_FAMILY
from spot.models.transformer import block_causal_mask
from tests import test_models_dream_llada2 as dream_llada2
from tests.reference_files import reference_checkpoint
from tests.tiny_checkpoints import EOS_IDS, MASK_ID, random_model, tiny_config, write_checkpoint

FAMILIES = ("sdar", "llada")


def _ids(length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 290, (1, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_save_reload_gives_same_logits(tmp_path, family, dtype):
    model = random_model(family, seed=3, dtype=dtype)
    save_checkpoint(tmp_path, family_for(family), model, MASK_ID, EOS_IDS)
    loaded = load_model(tmp_path)
    assert loaded.family.name == family  # detected from config.json model_type
    assert loaded.model.lm_head.weight.dtype == dtype
    ids = _ids(21)
    with torch.no_grad():
        assert torch.equal(model.full_logits(ids), loaded.model.full_logits(ids))
    assert loaded.decoding.mask_id == MASK_ID
    assert loaded.decoding.eos_ids == EOS_IDS


def test_saved_files_use_original_names_and_keys(tmp_path):
    write_checkpoint(tmp_path / "sdar", "sdar")
    write_checkpoint(tmp_path / "llada", "llada")
    from safetensors import safe_open

    with safe_open(tmp_path / "llada" / "model.safetensors", framework="pt") as f:
        names = set(f.keys())  # noqa: SIM118
    assert "model.transformer.blocks.1.ff_proj.weight" in names
    assert "model.transformer.ff_out.weight" in names
    assert not any(n.startswith("model.layers") for n in names)
    llada_config = reference_checkpoint("llada-8b-instruct") / "config.json"
    reference_keys = set(json.loads(llada_config.read_text()))
    written = json.loads((tmp_path / "llada" / "config.json").read_text())
    assert set(written) - {"torch_dtype"} <= reference_keys
    assert written["mask_token_id"] == MASK_ID
    sdar_keys = set(json.loads((reference_checkpoint("sdar-8b-chat") / "config.json").read_text()))
    written = json.loads((tmp_path / "sdar" / "config.json").read_text())
    assert set(written) - {"torch_dtype"} <= sdar_keys
    generation = json.loads((tmp_path / "sdar" / "generation_config.json").read_text())
    assert generation["eos_token_id"] == list(EOS_IDS)


def test_tied_embeddings_round_trip(tmp_path):
    model = random_model("sdar", seed=4, tie_word_embeddings=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    save_checkpoint(tmp_path, SDAR_FAMILY, model, MASK_ID, EOS_IDS)
    loaded = load_model(tmp_path).model
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    ids = _ids(9)
    with torch.no_grad():
        assert torch.equal(model.full_logits(ids), loaded.full_logits(ids))


def test_checkpoint_with_a_wrong_parameter_is_refused(tmp_path):
    write_checkpoint(tmp_path, "llada")
    config = json.loads((tmp_path / "config.json").read_text())
    config["n_layers"] = 3
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="missing"):
        load_model(tmp_path)


def test_sharded_checkpoint_loads(tmp_path):
    from safetensors.torch import load_file, save_file

    write_checkpoint(tmp_path, "sdar", seed=5)
    state = load_file(tmp_path / "model.safetensors")
    names = sorted(state)
    shards = {"model-00001-of-00002.safetensors": names[::2]}
    shards["model-00002-of-00002.safetensors"] = names[1::2]
    weight_map = {}
    for file, part in shards.items():
        save_file({n: state[n] for n in part}, tmp_path / file)
        weight_map.update(dict.fromkeys(part, file))
    (tmp_path / "model.safetensors").unlink()
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    ids = _ids(12)
    with torch.no_grad():
        expected = random_model("sdar", seed=5).full_logits(ids)
        assert torch.equal(load_model(tmp_path).model.full_logits(ids), expected)


def _later_token_changes_earlier_logits(target, block_length: int) -> bool:
    ids = _ids(24, seed=7)
    changed = ids.clone()
    changed[0, 21] = (changed[0, 21] + 1) % 290  # a token of the last block
    mask = target.attention_mask(24, block_length)
    with torch.no_grad():
        a = target.model.full_logits(ids, mask)[0, :16]  # the first two blocks
        b = target.model.full_logits(changed, mask)[0, :16]
    return not torch.equal(a, b)


def test_block_causal_earlier_blocks_ignore_later_tokens(tmp_path):
    target = load_target(write_checkpoint(tmp_path, "sdar"))
    assert not _later_token_changes_earlier_logits(target, block_length=8)


def test_bidirectional_earlier_positions_see_later_tokens(tmp_path):
    target = load_target(write_checkpoint(tmp_path, "llada"))
    assert _later_token_changes_earlier_logits(target, block_length=8)


def test_block_causal_mask_is_blockwise_lower_triangular():
    mask = block_causal_mask(6, 2)[0, 0]
    expected = torch.tensor(
        [
            [1, 1, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [1, 1, 1, 1, 0, 0],
            [1, 1, 1, 1, 0, 0],
            [1, 1, 1, 1, 1, 1],
            [1, 1, 1, 1, 1, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(mask, expected)


def test_family_traits():
    assert family_for(raw_config={"model_type": "sdar"}) is SDAR_FAMILY
    assert family_for(raw_config={"model_type": "llada"}) is LLADA_FAMILY
    with pytest.raises(ValueError, match="not a known target family"):
        family_for(raw_config={"model_type": "gpt2"})
    assert (SDAR_FAMILY.confidence, LLADA_FAMILY.confidence) == ("tempered", "untempered")
    assert SDAR_FAMILY.block_causal and SDAR_FAMILY.absolute_block_grid
    assert not LLADA_FAMILY.block_causal and not LLADA_FAMILY.absolute_block_grid


# -- the real checkpoints' parameter lists, on the meta device ---------------------------------
def _index_names(name: str) -> set[str]:
    index = json.loads((reference_checkpoint(name) / "model.safetensors.index.json").read_text())
    return set(index["weight_map"])


@pytest.mark.parametrize(
    ("name", "hidden", "intermediate", "params_billion"),
    [("sdar-8b-chat", 4096, 12288, 8.19), ("sdar-4b-chat", 2560, 9728, 4.41)],
)
def test_real_sdar_parameters_map_on_meta(name, hidden, intermediate, params_billion):
    loaded = load_model(reference_checkpoint(name), device="meta")
    model = loaded.model
    assert model.lm_head.weight.is_meta
    shapes = original_shapes(loaded.family, model)
    assert set(shapes) == _index_names(name)
    heads, kv_heads, head_dim, vocab = 32, 8, 128, 151936
    assert shapes["model.embed_tokens.weight"] == (vocab, hidden)
    assert shapes["lm_head.weight"] == (vocab, hidden)
    assert shapes["model.layers.35.self_attn.q_proj.weight"] == (heads * head_dim, hidden)
    assert shapes["model.layers.0.self_attn.k_proj.weight"] == (kv_heads * head_dim, hidden)
    assert shapes["model.layers.0.self_attn.o_proj.weight"] == (hidden, heads * head_dim)
    assert shapes["model.layers.0.self_attn.q_norm.weight"] == (head_dim,)
    assert shapes["model.layers.7.mlp.gate_proj.weight"] == (intermediate, hidden)
    assert shapes["model.layers.7.mlp.down_proj.weight"] == (hidden, intermediate)
    total = sum(p.numel() for p in model.parameters())
    assert total / 1e9 == pytest.approx(params_billion, abs=0.01)
    decoding = loaded.decoding
    assert decoding.mask_id == 151669
    assert decoding.eos_ids == (151645, 151643)  # <|im_end|>, <|endoftext|>
    assert decoding.block_causal and decoding.absolute_block_grid
    assert decoding.max_length == 32768


def test_real_llada_parameters_map_on_meta():
    llada = reference_checkpoint("llada-8b-instruct")
    loaded = load_model(llada, device="meta", dtype=torch.bfloat16)
    model = loaded.model
    assert model.lm_head.weight.is_meta and model.lm_head.weight.dtype == torch.bfloat16
    shapes = original_shapes(loaded.family, model)
    assert set(shapes) == _index_names("llada-8b-instruct")
    d, mlp, vocab = 4096, 12288, 126464
    assert shapes["model.transformer.wte.weight"] == (vocab, d)
    assert shapes["model.transformer.ff_out.weight"] == (vocab, d)
    assert shapes["model.transformer.blocks.31.q_proj.weight"] == (d, d)
    assert shapes["model.transformer.blocks.0.k_proj.weight"] == (d, d)  # n_kv_heads 32
    assert shapes["model.transformer.blocks.0.attn_out.weight"] == (d, d)
    assert shapes["model.transformer.blocks.0.ff_proj.weight"] == (mlp, d)
    assert shapes["model.transformer.blocks.0.up_proj.weight"] == (mlp, d)
    assert shapes["model.transformer.blocks.0.ff_out.weight"] == (d, mlp)
    assert shapes["model.transformer.blocks.0.attn_norm.weight"] == (d,)
    total = sum(p.numel() for p in model.parameters())
    assert total / 1e9 == pytest.approx(8.02, abs=0.01)
    decoding = loaded.decoding
    assert decoding.mask_id == 126336
    assert decoding.eos_ids == (126081, 126348)  # <|endoftext|>, then <|eot_id|>
    assert not decoding.block_causal and not decoding.absolute_block_grid
    assert decoding.max_length == 4096
    config = model.config
    assert config.rope_theta == 500000.0 and config.rope_full_precision
    assert config.rms_norm_eps == 1e-5


def test_meta_load_refuses_a_foreign_key_list(tmp_path):
    sdar = reference_checkpoint("sdar-4b-chat")
    for file in ("config.json", "generation_config.json"):
        (tmp_path / file).write_text((sdar / file).read_text())
    index = json.loads((sdar / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.layers.0.self_attn.q_proj.bias"] = "model-00001.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="unexpected"):
        load_model(tmp_path, device="meta")


# (family, config.json key, a value the native model does not implement, the refusal)
UNSUPPORTED = [
    ("sdar", "rope_scaling", {"type": "linear", "factor": 2.0}, "SDAR rope_scaling is not"),
    ("sdar", "use_sliding_window", True, "SDAR sliding-window attention is not supported"),
    ("sdar", "hidden_act", "gelu", "SDAR hidden_act 'gelu' is not supported"),
    ("dream", "rope_scaling", {"type": "linear", "factor": 2.0}, "Dream rope_scaling is not"),
    ("dream", "use_sliding_window", True, "Dream sliding-window attention is not supported"),
    ("dream", "hidden_act", "gelu", "Dream hidden_act 'gelu' is not supported"),
    ("llada", "alibi", True, "LLaDA alibi=True is not supported (needs False)"),
    ("llada2", "score_function", "softmax", "LLaDA2 score_function='softmax' is not supported"),
    ("llada2", "rope_scaling", {"type": "linear", "factor": 2.0}, "LLaDA2 rope_scaling is not"),
]


@pytest.mark.parametrize(("family", "key", "value", "refusal"), UNSUPPORTED)
def test_config_options_the_native_model_lacks_are_refused(family, key, value, refusal):
    fam = family_for(family)
    config = dream_llada2.tiny_config(family) if family in dream_llada2.FAMILIES else None
    raw = fam.original_config(config or tiny_config(family), MASK_ID, EOS_IDS)
    fam.native_config(raw)  # as written, it is read back
    with pytest.raises(ValueError, match=re.escape(refusal)):
        fam.native_config({**raw, key: value})
