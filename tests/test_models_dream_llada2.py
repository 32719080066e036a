"""Dream and LLaDA2.0 native targets: original-format checkpoints, attention regimes, Dream's
logit shift, LLaDA2.0's cache and MoE routing, the real checkpoints' parameter lists on the
meta device, faithfulness to each reference loop, and batch-invariant decoding (speculative ==
draft-free for every family is in tests/test_target_equivalence.py)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from spot.config import DecodingConfig
from spot.decode import Request, generate
from spot.models.dream import DREAM_FAMILY
from spot.models.llada2 import LLADA2_FAMILY, LLaDA2Config
from spot.models.loading import load_model, load_target, original_shapes, save_checkpoint
from spot.models.moe import MoESpec, SparseMoE
from spot.models.registry import family_for
from spot.models.target import DiffusionTarget
from spot.models.transformer import Transformer, TransformerConfig
from spot.target import Window
from tests.reference_loops import NEG_INF, get_num_transfer_tokens, greedy, llada2_generate
from tests.tiny_checkpoints import MASK_ID, VOCAB

FAMILIES = ("dream", "llada2")
EOS = 298  # the one EOS id of the tiny checkpoints (LLaDA2.0's generate knows one)
B = 4  # block length of the hand-made windows
EOS_BOOST = {"dream": 1.7, "llada2": 1.3}  # some requests of the tests below end with EOS


# -- tiny random checkpoints ------------------------------------------------------------------
def tiny_config(family: str) -> TransformerConfig:
    base = {
        "vocab_size": VOCAB,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_layers": 2,
        "num_heads": 4,
        "num_kv_heads": 2,
        "head_dim": 8,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 512,
    }
    if family == "dream":
        return TransformerConfig(**base, rope_theta=1e6, qkv_bias=True)
    return LLaDA2Config(
        **{**base, "num_layers": 3},
        rope_theta=600000.0,
        rotary_dim=4,  # partial_rotary_factor 0.5
        qk_norm=True,
        num_experts=8,
        experts_per_token=3,
        expert_size=16,
        num_shared_experts=1,
        num_groups=4,
        groups_per_token=2,
        routed_scaling_factor=2.5,
        first_dense_layers=1,
    )


def random_model(family: str, seed: int = 0, dtype: torch.dtype = torch.float64) -> Transformer:
    """Seeded weights scaled for peaked predictions; the mask token's output row is the mean
    of the others (never the argmax), the EOS row is boosted so requests end now and then."""
    config = tiny_config(family)
    model = family_for(family).build(config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=generator)
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * noise)
            elif p.dim() >= 2:
                fan_in = 1 if "embed" in name else p.shape[-1]
                p.copy_(noise * 1.5 / fan_in**0.5)
            else:
                p.copy_(0.1 * noise)
        for _, buffer in model.named_buffers():  # the routers' expert_bias
            buffer.copy_(0.2 * torch.randn(buffer.shape, generator=generator))
        head = model.lm_head.weight
        others = torch.ones(config.vocab_size, dtype=torch.bool)
        others[MASK_ID] = False
        head[EOS] *= EOS_BOOST[family]
        head[MASK_ID] = head[others].mean(0)
    return model.to(dtype).eval()


def write_checkpoint(directory: Path, family: str, seed: int = 0, dtype=torch.float64) -> Path:
    model = random_model(family, seed, dtype)
    return save_checkpoint(directory, family_for(family), model, MASK_ID, (EOS,))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("checkpoints")
    return {
        (family, dtype): write_checkpoint(root / f"{family}-{dtype}", family, 11, dtype)
        for family in FAMILIES
        for dtype in (torch.float64, torch.float32)
    }


def _target(checkpoints, family: str, dtype=torch.float64) -> DiffusionTarget:
    return load_target(checkpoints[family, dtype])


def _tokens(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 290, (n,), generator=torch.Generator().manual_seed(seed))


def _masks(n: int) -> torch.Tensor:
    return torch.full((n,), MASK_ID, dtype=torch.long)


def _partly_masked(n: int, seed: int) -> torch.Tensor:
    block = _tokens(n, seed)
    block[torch.randperm(n, generator=torch.Generator().manual_seed(seed))[: n // 2]] = MASK_ID
    return block


def _full_logits(target: DiffusionTarget, seq: torch.Tensor, block_length: int = B):
    """Logits [L, V] of a whole sequence under the family's own attention, from scratch."""
    mask = target.attention_mask(seq.numel(), block_length)
    with torch.no_grad():
        return target.model.full_logits(seq[None], mask)[0]


# -- checkpoints in the original format -------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_save_reload_gives_same_logits(tmp_path, family, dtype):
    model = random_model(family, seed=3, dtype=dtype)
    save_checkpoint(tmp_path, family_for(family), model, MASK_ID, (EOS,))
    loaded = load_model(tmp_path)
    assert loaded.family.name == family  # detected from config.json's model_type
    assert loaded.model.config == model.config
    ids = _tokens(21, seed=1)[None]
    with torch.no_grad():
        assert torch.equal(model.full_logits(ids), loaded.model.full_logits(ids))
    assert (loaded.decoding.mask_id, loaded.decoding.eos_ids) == (MASK_ID, (EOS,))


def _stored_names(directory: Path) -> set[str]:
    with safe_open(directory / "model.safetensors", framework="pt") as f:
        return set(f.keys())  # noqa: SIM118 (safe_open has no __iter__)


def test_saved_files_use_original_names_and_keys(tmp_path):
    dream = write_checkpoint(tmp_path / "dream", "dream")
    names = _stored_names(dream)
    assert {"model.embed_tokens.weight", "model.layers.1.self_attn.k_proj.bias"} <= names
    assert "model.layers.1.self_attn.o_proj.bias" not in names
    written = json.loads((dream / "config.json").read_text())
    assert written["model_type"] == "Dream" and written["architectures"] == ["DreamModel"]
    assert set(written) - {"torch_dtype"} <= set(DREAM_7B_CONFIG)

    llada2 = write_checkpoint(tmp_path / "llada2", "llada2")
    names = _stored_names(llada2)
    assert {
        "model.word_embeddings.weight",
        "model.layers.0.attention.query_key_value.weight",
        "model.layers.0.attention.query_layernorm.weight",
        "model.layers.0.attention.dense.weight",
        "model.layers.0.mlp.up_proj.weight",
        "model.layers.2.mlp.gate.weight",
        "model.layers.2.mlp.gate.expert_bias",
        "model.layers.2.mlp.experts.7.down_proj.weight",
        "model.layers.2.mlp.shared_experts.gate_proj.weight",
    } <= names
    assert not any("self_attn" in n or "embed_tokens" in n for n in names)
    written = json.loads((llada2 / "config.json").read_text())
    assert written["model_type"] == "llada2_moe"
    # the published keys, plus the special tokens the tiny vocabulary needs written down
    extra = {"torch_dtype", "mask_token_id", "eos_token_id"}
    assert set(written) - extra <= set(LLADA2_MINI_CONFIG)


def test_fused_qkv_rows_are_query_then_key_then_value_heads(tmp_path):
    """The reference views the fused projection as (heads + 2 kv_heads, head_dim) and splits
    it [heads, kv_heads, kv_heads]; the native q/k/v projections must be those rows."""
    model = random_model("llada2", seed=2)
    config = model.config
    fused = _stored_fused(write_checkpoint(tmp_path, "llada2", seed=2))
    x = torch.randn(5, config.hidden_size, dtype=torch.float64)
    heads = (x @ fused.T).view(5, config.num_heads + 2 * config.num_kv_heads, config.head_dim)
    q, k, v = heads.split([config.num_heads, config.num_kv_heads, config.num_kv_heads], dim=1)
    attention = model.model.layers[0].self_attn
    with torch.no_grad():
        for native, ref in ((attention.q_proj, q), (attention.k_proj, k), (attention.v_proj, v)):
            torch.testing.assert_close(native(x).view_as(ref), ref, rtol=0, atol=1e-12)


def _stored_fused(directory: Path) -> torch.Tensor:
    with safe_open(directory / "model.safetensors", framework="pt") as f:
        return f.get_tensor("model.layers.0.attention.query_key_value.weight")


# -- attention regimes and Dream's shift ------------------------------------------------------
def _logits_after_change(target: DiffusionTarget, position: int) -> torch.Tensor:
    """|Δ logits| [L] per position when the token at `position` of a 24-token sequence
    changes, under the family's own attention with blocks of 8."""
    ids = _tokens(24, seed=7)
    changed = ids.clone()
    changed[position] = (changed[position] + 1) % 290
    delta = _full_logits(target, ids, 8) - _full_logits(target, changed, 8)
    return delta.abs().amax(-1)


def test_dream_earlier_positions_see_later_tokens(checkpoints):
    delta = _logits_after_change(_target(checkpoints, "dream"), position=21)
    assert bool((delta[:16] > 1e-6).all())


def test_llada2_earlier_blocks_ignore_later_tokens_but_the_block_sees_itself(checkpoints):
    delta = _logits_after_change(_target(checkpoints, "llada2"), position=21)
    # blocks 0 and 1 unchanged up to rounding: the changed token's expert choice changes how
    # the other tokens are grouped per expert, and so the last bits of their products
    assert bool((delta[:16] < 1e-12).all())
    assert bool((delta[16:21] > 1e-6).all())  # earlier positions of the same block


def test_dream_logits_of_a_position_come_from_the_previous_one(checkpoints):
    target = _target(checkpoints, "dream")
    prompt, total = _tokens(6, seed=3), 18
    ctx = target.open(prompt, total)
    assert target.committed_length(ctx) == 6  # blocks start at the end of the prompt
    window = torch.cat([_tokens(B, 4), _partly_masked(B, 5)])
    logits = target.score([ctx], [Window(0, window)], B).logits[0]
    canvas = torch.cat([prompt, window, _masks(total - 6 - 2 * B)])  # masks to the end
    full = _full_logits(target, canvas)
    # the current block is positions 10..13; Dream reads them from the outputs at 9..12
    torch.testing.assert_close(logits, full[9:13], rtol=0, atol=1e-12)
    first = target.score([ctx], [Window(0, _masks(B))], B).logits[0, 0]
    torch.testing.assert_close(first, _full_logits(target, torch.cat([prompt, _masks(12)]))[5])


# -- LLaDA2.0's exact KV cache and batching ---------------------------------------------------
def test_llada2_cached_blocks_equal_full_recomputation(checkpoints):
    """Block by block through the cache (a finished block stored from the forward that scores
    the next one) equals recomputing the sequence from position 0 under the block mask."""
    target = _target(checkpoints, "llada2")
    prompt = _tokens(10, seed=1)
    ctx = target.open(prompt, 28)
    assert target.committed_length(ctx) == 0
    final = prompt[:0]
    steps = [  # per forward: windows of (tokens, keep); the prompt's end is in block 2
        [(torch.cat([prompt, _masks(2)]), 8)],
        [(torch.cat([prompt[8:], _tokens(2, 2)]), 0), (_partly_masked(B, 3), 0)],
        [(torch.cat([prompt[8:], _tokens(2, 4), _partly_masked(B, 5)]), B)],
        [(torch.cat([_tokens(B, 6), _masks(B)]), B), (torch.cat([_tokens(B, 7), _masks(B)]), 0)],
    ]
    for windows in steps:
        start = target.committed_length(ctx)
        assert start == final.numel()
        batch = [Window(0, tokens, keep) for tokens, keep in windows]
        logits = target.score([ctx], batch, B).logits
        for i, (tokens, _) in enumerate(windows):
            seq = torch.cat([final, tokens])
            expected = _full_logits(target, seq)[-B:]
            torch.testing.assert_close(logits[i], expected, rtol=0, atol=1e-10)
        final = torch.cat([final] + [tokens[:keep] for tokens, keep in windows if keep])


def _warm_contexts(target: DiffusionTarget, prompts, total: int):
    """Open each request and commit some blocks, so caches / committed lengths differ."""
    contexts = [target.open(p, total) for p in prompts]
    for i, (ctx, p) in enumerate(zip(contexts, prompts)):
        start = target.committed_length(ctx)
        extra = (2 + i) * B - (p.numel() - start) % B
        window = torch.cat([p[start:], _tokens(extra, 20 + i)])
        target.score([ctx], [Window(0, window, window.numel() - B)], B)
    return contexts


def _candidate_windows(seed: int):
    """Per request: a root keeping one block, and candidates one or two blocks long."""
    windows = []
    for c in range(3):
        done = _tokens(B, seed + c)
        windows.append(Window(c, torch.cat([done, _partly_masked(B, seed + 10 + c)]), B))
        for k in range(1 + c):
            block = _partly_masked(B, seed + 50 + 7 * c + k)
            middle = [_tokens(B, seed + 30 + 7 * c + k)] if k % 2 else []
            windows.append(Window(c, torch.cat([done, *middle, block])))
    return windows


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(("dtype", "atol"), [(torch.float64, 1e-10), (torch.float32, 1e-4)])
def test_batch_of_candidates_equals_each_alone(checkpoints, family, dtype, atol):
    target = _target(checkpoints, family, dtype)
    prompts = [_tokens(n, seed=n) for n in (3, 7, 13)]
    together = _warm_contexts(target, prompts, 48)
    alone = _warm_contexts(target, prompts, 48)
    assert len({target.committed_length(c) for c in together}) == 3
    for round_seed in (100, 200):  # the second round runs on what the first one committed
        windows = _candidate_windows(round_seed)
        batched = target.score(together, windows, B, output_hidden=True)
        for i, w in sorted(enumerate(windows), key=lambda item: item[1].keep):
            single = target.score([alone[w.context]], [replace(w, context=0)], B, True)
            torch.testing.assert_close(batched.logits[i], single.logits[0], rtol=0, atol=atol)
            torch.testing.assert_close(batched.hidden[i], single.hidden[0], rtol=0, atol=atol)
        assert [target.committed_length(c) for c in together] == [
            target.committed_length(c) for c in alone
        ]


# -- MoE routing ------------------------------------------------------------------------------
SPEC = MoESpec(16, 8, 3, 12, 24, num_groups=4, groups_per_token=2, scaling=2.5)


def _random_moe(seed: int) -> SparseMoE:
    moe = SparseMoE(SPEC).double()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in [*moe.parameters(), *moe.buffers()]:
            p.copy_(0.4 * torch.randn(p.shape, generator=generator))
    return moe


def _reference_moe(moe: SparseMoE, x: torch.Tensor) -> torch.Tensor:
    """The hub's LLaDA2MoeGate + moe_infer, written out token by token. x [T, H]."""
    spec, out = moe.spec, []
    size = spec.num_experts // spec.num_groups
    for token in x:
        scores = torch.sigmoid(moe.gate.weight @ token)  # [E]
        biased = scores + moe.gate.expert_bias
        group_scores = biased.view(spec.num_groups, size).topk(2).values.sum(-1)
        groups = group_scores.topk(spec.groups_per_token).indices
        allowed = torch.full_like(biased, NEG_INF)
        for g in groups.tolist():
            allowed[g * size : (g + 1) * size] = biased[g * size : (g + 1) * size]
        chosen = allowed.topk(spec.experts_per_token).indices
        weights = scores[chosen] / (scores[chosen].sum() + 1e-20) * spec.scaling
        total = moe.shared_experts(token)
        for w, e in zip(weights, chosen.tolist()):
            total = total + w * moe.experts(e, token[None])[0]
        out.append(total)
    return torch.stack(out)


def test_moe_matches_the_reference_routing_token_by_token():
    moe = _random_moe(0)
    x = torch.randn(2, 7, 16, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(
            moe(x).view(14, 16), _reference_moe(moe, x.view(14, 16)), rtol=0, atol=1e-12
        )


def test_expert_bias_chooses_experts_but_does_not_weigh_them():
    moe = _random_moe(2)
    with torch.no_grad():
        moe.gate.expert_bias.zero_()
        moe.gate.weight.zero_()
        moe.gate.weight[:, 0] = torch.tensor([4.0, 3.0, 2.5, 0.0, -1.0, -2.0, -3.0, -4.0])
        x = torch.zeros(1, 16, dtype=torch.float64)
        x[0, 0] = 1.0
        chosen, weights = moe.gate(x)
        # groups {0,1} {2,3} {4,5} {6,7}: the two best groups are the first two
        assert chosen.tolist() == [[0, 1, 2]]
        moe.gate.expert_bias[5] = 10.0  # lifts group {4,5} above group {2,3}, and expert 5
        biased, biased_weights = moe.gate(x)
        assert biased.tolist() == [[5, 0, 1]]
        scores = torch.sigmoid(torch.tensor([-2.0, 4.0, 3.0], dtype=torch.float64))
        torch.testing.assert_close(biased_weights[0], scores / scores.sum() * 2.5)
        assert weights.sum().item() == pytest.approx(2.5)


def test_group_limit_can_drop_a_strong_expert():
    moe = _random_moe(3)
    with torch.no_grad():
        moe.gate.expert_bias.zero_()
        moe.gate.weight.zero_()
        # expert 6 is the single best, but its group {6,7} sums below {0,1} and {2,3}
        moe.gate.weight[:, 0] = torch.tensor([2.0, 2.0, 1.8, 1.8, -5.0, -5.0, 3.0, -6.0])
        x = torch.zeros(1, 16, dtype=torch.float64)
        x[0, 0] = 1.0
        chosen, _ = moe.gate(x)
    assert 6 not in chosen.tolist()[0]
    assert sorted(chosen.tolist()[0]) in ([0, 1, 2], [0, 1, 3])


# -- the real checkpoints' parameter lists, on the meta device --------------------------------
# Dream-org/Dream-v0-Instruct-7B config.json (Qwen2.5-7B layout; values as published)
DREAM_7B_CONFIG = {
    "architectures": ["DreamModel"],
    "attention_dropout": 0.0,
    "auto_map": {
        "AutoConfig": "configuration_dream.DreamConfig",
        "AutoModel": "modeling_dream.DreamModel",
    },
    "bos_token_id": 151643,
    "eos_token_id": 151643,
    "hidden_act": "silu",
    "hidden_size": 3584,
    "initializer_range": 0.02,
    "intermediate_size": 18944,
    "mask_token_id": 151666,
    "max_position_embeddings": 131072,
    "max_window_layers": 28,
    "model_type": "Dream",
    "num_attention_heads": 28,
    "num_hidden_layers": 28,
    "num_key_value_heads": 4,
    "pad_token_id": 151643,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.46.2",
    "use_cache": False,
    "use_sliding_window": False,
    "vocab_size": 152064,
}

# inclusionAI/LLaDA2.0-mini config.json: the mini config published with inclusionAI/dFactory
# (configs/model_configs/llada2_mini) under the hub's model_type, with the model card's 32k
# context and the hub's QK-norm
LLADA2_MINI_CONFIG = {
    "architectures": ["LLaDA2MoeModelLM"],
    "attention_dropout": 0.0,
    "auto_map": {
        "AutoConfig": "configuration_llada2_moe.LLaDA2MoeConfig",
        "AutoModel": "modeling_llada2_moe.LLaDA2MoeModel",
        "AutoModelForCausalLM": "modeling_llada2_moe.LLaDA2MoeModelLM",
    },
    "num_hidden_layers": 20,
    "hidden_size": 2048,
    "intermediate_size": 5120,
    "first_k_dense_replace": 1,
    "hidden_act": "silu",
    "max_position_embeddings": 32768,
    "model_type": "llada2_moe",
    "moe_intermediate_size": 512,
    "norm_topk_prob": True,
    "num_experts_per_tok": 8,
    "norm_head": False,
    "num_attention_heads": 16,
    "num_experts": 256,
    "num_key_value_heads": 4,
    "rope_theta": 600000,
    "rope_scaling": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.52.3",
    "use_bias": False,
    "use_rmsnorm": True,
    "rms_norm_eps": 1e-06,
    "head_dim": 128,
    "num_shared_experts": 1,
    "use_cache": False,
    "use_qk_norm": True,
    "use_qkv_bias": False,
    "embedding_dropout": 0.0,
    "norm_softmax": False,
    "output_dropout": 0.0,
    "vocab_size": 157184,
    "rotary_dim": 64,
    "using_split_qkv_in_self_attention": False,
    "router_dtype": "fp32",
    "moe_router_enable_expert_bias": True,
    "routed_scaling_factor": 2.5,
    "n_group": 8,
    "topk_group": 4,
    "score_function": "sigmoid",
    "initializer_range": 0.02,
    "max_window_layers": 28,
    "output_router_logits": False,
    "pad_token_id": 156892,
    "partial_rotary_factor": 0.5,
    "use_sliding_window": False,
}

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def _dream_7b_names() -> list[str]:
    """Qwen2 names with q/k/v biases (DreamModel wraps the decoder as `model`)."""
    names = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    for i in range(28):
        layer = f"model.layers.{i}."
        names += [
            layer + f"self_attn.{p}_proj.{kind}" for p in "qkv" for kind in ("weight", "bias")
        ]
        names += [layer + "self_attn.o_proj.weight"]
        names += [layer + f"mlp.{p}.weight" for p in PROJECTIONS]
        names += [layer + "input_layernorm.weight", layer + "post_attention_layernorm.weight"]
    return names


def _llada2_mini_names() -> list[str]:
    """Ling 2.0 names: fused attention, layer 0 dense, 19 MoE layers of 256 experts."""
    names = ["model.word_embeddings.weight", "model.norm.weight", "lm_head.weight"]
    for i in range(20):
        layer = f"model.layers.{i}."
        names += [layer + "input_layernorm.weight", layer + "post_attention_layernorm.weight"]
        names += [layer + f"attention.{p}.weight" for p in ("query_key_value", "dense")]
        names += [layer + f"attention.{p}.weight" for p in ("query_layernorm", "key_layernorm")]
        if i == 0:
            names += [layer + f"mlp.{p}.weight" for p in PROJECTIONS]
            continue
        names += [layer + "mlp.gate.weight", layer + "mlp.gate.expert_bias"]
        names += [layer + f"mlp.shared_experts.{p}.weight" for p in PROJECTIONS]
        names += [layer + f"mlp.experts.{e}.{p}.weight" for e in range(256) for p in PROJECTIONS]
    return names


def _write_metadata(directory: Path, config: dict, names: list[str]) -> Path:
    """config.json and an index naming every parameter (the shards themselves absent)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    shard = "model-00001-of-00004.safetensors"
    index = {"metadata": {}, "weight_map": dict.fromkeys(names, shard)}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    return directory


def test_real_dream_parameters_map_on_meta(tmp_path):
    directory = _write_metadata(tmp_path, DREAM_7B_CONFIG, _dream_7b_names())
    loaded = load_model(directory, device="meta", dtype=torch.bfloat16)
    model = loaded.model
    assert loaded.family is DREAM_FAMILY
    assert model.lm_head.weight.is_meta and model.lm_head.weight.dtype == torch.bfloat16
    shapes = original_shapes(loaded.family, model)
    assert set(shapes) == set(_dream_7b_names())
    hidden, kv, vocab, mlp = 3584, 4 * 128, 152064, 18944
    assert shapes["model.embed_tokens.weight"] == (vocab, hidden)
    assert shapes["lm_head.weight"] == (vocab, hidden)
    assert shapes["model.layers.27.self_attn.q_proj.weight"] == (hidden, hidden)
    assert shapes["model.layers.0.self_attn.q_proj.bias"] == (hidden,)
    assert shapes["model.layers.0.self_attn.k_proj.weight"] == (kv, hidden)
    assert shapes["model.layers.0.self_attn.v_proj.bias"] == (kv,)
    assert shapes["model.layers.0.self_attn.o_proj.weight"] == (hidden, hidden)
    assert shapes["model.layers.3.mlp.gate_proj.weight"] == (mlp, hidden)
    assert shapes["model.layers.3.mlp.down_proj.weight"] == (hidden, mlp)
    total = sum(p.numel() for p in model.parameters())
    assert total / 1e9 == pytest.approx(7.62, abs=0.01)  # Qwen2.5-7B
    decoding = loaded.decoding
    assert (decoding.mask_id, decoding.eos_ids) == (151666, (151643,))
    assert decoding.logit_shift and not decoding.block_causal
    assert not decoding.absolute_block_grid and decoding.confidence == "tempered"
    assert model.config.rope_theta == 1e6 and model.config.head_dim == 128


def test_real_llada2_mini_parameters_map_on_meta(tmp_path):
    directory = _write_metadata(tmp_path, LLADA2_MINI_CONFIG, _llada2_mini_names())
    loaded = load_model(directory, device="meta")
    model = loaded.model
    assert loaded.family is LLADA2_FAMILY
    shapes = original_shapes(loaded.family, model)
    assert set(shapes) == set(_llada2_mini_names())
    hidden, head_dim, vocab = 2048, 128, 157184
    assert shapes["model.word_embeddings.weight"] == (vocab, hidden)
    assert shapes["lm_head.weight"] == (vocab, hidden)
    qkv = (16 + 2 * 4) * head_dim
    assert shapes["model.layers.0.attention.query_key_value.weight"] == (qkv, hidden)
    assert shapes["model.layers.19.attention.dense.weight"] == (hidden, 16 * head_dim)
    assert shapes["model.layers.5.attention.query_layernorm.weight"] == (head_dim,)
    assert shapes["model.layers.0.mlp.gate_proj.weight"] == (5120, hidden)
    assert shapes["model.layers.0.mlp.down_proj.weight"] == (hidden, 5120)
    assert shapes["model.layers.1.mlp.gate.weight"] == (256, hidden)
    assert shapes["model.layers.1.mlp.gate.expert_bias"] == (256,)
    assert shapes["model.layers.19.mlp.experts.255.up_proj.weight"] == (512, hidden)
    assert shapes["model.layers.19.mlp.experts.0.down_proj.weight"] == (hidden, 512)
    assert shapes["model.layers.1.mlp.shared_experts.gate_proj.weight"] == (512, hidden)
    total = sum(p.numel() for p in model.parameters())
    assert total / 1e9 == pytest.approx(16.26, abs=0.01)  # "16B total parameters"
    config = model.config
    assert (config.rotary_dim, config.qk_norm, config.qkv_bias, config.o_bias) == (
        64,
        True,
        False,
        False,
    )
    decoding = loaded.decoding
    assert (decoding.mask_id, decoding.eos_ids) == (156895, (156892,))
    assert decoding.block_causal and decoding.absolute_block_grid
    assert decoding.max_length == 32768 and decoding.confidence == "tempered"


def test_meta_load_refuses_a_missing_expert(tmp_path):
    names = [n for n in _llada2_mini_names() if n != "model.layers.7.mlp.experts.3.up_proj.weight"]
    with pytest.raises(ValueError, match="missing"):
        load_model(_write_metadata(tmp_path, LLADA2_MINI_CONFIG, names), device="meta")


def test_unsupported_routing_is_refused():
    for key, value in (("score_function", "softmax"), ("norm_head", True)):
        with pytest.raises(ValueError, match=key):
            LLADA2_FAMILY.native_config({**LLADA2_MINI_CONFIG, key: value})


# -- decoding: faithful to the references, speculative == draft-free --------------------------
def _requests(count: int = 3) -> list[Request]:
    lengths = (5, 11, 8, 3)[:count]
    return [Request(_tokens(n, seed=40 + n), key=1000 + i) for i, n in enumerate(lengths)]


def _end_of_eos_block(tokens: torch.Tensor, offset: int, block_length: int) -> int | None:
    """Index, among generated positions, of the end of the block holding the first EOS (the
    grid starting `offset` positions before the first generated one), None without EOS:
    where the decode loop stops and EOS-fills the rest."""
    eos = (tokens == EOS).nonzero().flatten()
    if not eos.numel():
        return None
    return -(-(int(eos[0]) + offset + 1) // block_length) * block_length - offset


def dream_generate(
    model: Transformer, prompt: torch.Tensor, gen_length: int, block_length: int, steps: int
) -> torch.Tensor:
    """Dream's block sampler at T=0 with `maskgit_plus` confidence, written out: the whole
    canvas (prompt, then masks to the end) bidirectionally at every step, logits shifted by
    one, blocks from the end of the prompt; each block opens by committing its first position
    (as Fast-dLLM's block sampler does), then the rest is split evenly over `steps`."""
    p = prompt.numel()
    x = torch.cat([prompt, _masks(gen_length)])

    def shifted_logits():
        with torch.no_grad():
            logits = model.full_logits(x[None])[0]
        return torch.cat([logits[:1], logits[:-1]])  # Dream's shift

    for lo in range(p, p + gen_length, block_length):
        x[lo] = greedy(shifted_logits()[lo : lo + 1])[0][0]
        schedule = get_num_transfer_tokens(block_length - 1, steps)
        for step in range(steps):
            x0, x0_p = greedy(shifted_logits()[lo : lo + block_length])
            masked = x[lo : lo + block_length] == MASK_ID
            confidence = torch.where(masked, x0_p, NEG_INF)
            chosen = torch.topk(confidence, int(schedule[step])).indices
            x[lo + chosen] = x0[chosen]
    return x[p:]


@pytest.mark.parametrize("tokens_per_step", [1, 2])
def test_dream_draft_free_decoding_is_its_reference_loop(checkpoints, tokens_per_step):
    target = _target(checkpoints, "dream")
    config = DecodingConfig(gen_length=12, block_length=4, tokens_per_step=tokens_per_step)
    requests = _requests(3)
    results = generate(target, requests, config)
    for request, result in zip(requests, results):
        steps = config.steps_per_block
        expected = dream_generate(target.model, request.prompt, 12, 4, steps)
        end = _end_of_eos_block(expected, 0, 4)
        assert torch.equal(result.tokens[:end], expected[:end])
        if end is not None:  # Dream's own loop goes on decoding the positions after it
            assert bool((result.tokens[end:] == EOS).all())


@pytest.mark.parametrize(("tokens_per_step", "threshold"), [(1, 0.3), (2, 0.95), (4, 1.0)])
def test_llada2_draft_free_decoding_is_its_reference_loop(checkpoints, tokens_per_step, threshold):
    target = _target(checkpoints, "llada2")
    config = DecodingConfig(
        gen_length=12,
        block_length=4,
        rule="sdar_dynamic",
        tokens_per_step=tokens_per_step,
        threshold=threshold,
    )
    requests = _requests(3)
    results = generate(target, requests, config)
    for request, result in zip(requests, results):
        p = request.prompt.numel()
        expected = llada2_generate(
            target.model,
            request.prompt,
            mask_id=MASK_ID,
            eos_id=EOS,
            gen_length=12,
            block_length=4,
            steps=config.steps_per_block,
            threshold=threshold,
        )
        assert torch.equal(result.tokens[: expected.numel()], expected)
        end = _end_of_eos_block(expected, p, 4)
        assert result.finish_reason == ("length" if end is None else "eos")
        if end is not None:  # the rest of the EOS block was decoded, then the tail is EOS
            assert bool((result.tokens[end:] == EOS).all())


@pytest.mark.parametrize("family", FAMILIES)
def test_generate_end_to_end(checkpoints, family):
    target = _target(checkpoints, family)
    config = DecodingConfig(gen_length=16, block_length=8, tokens_per_step=2)
    requests = _requests(4)
    results = generate(target, requests, config)
    for request, result in zip(requests, results):
        prompt = request.prompt.numel()
        expected = 16 if family == "dream" else -(-(prompt + 16) // 8) * 8 - prompt
        assert result.tokens.numel() == expected
        assert not bool((result.tokens == MASK_ID).any())
        assert 0 < result.stats.nfe <= result.stats.steps
    for i, request in enumerate(requests):  # alone, and in reverse order
        assert torch.equal(generate(target, [request], config)[0].tokens, results[i].tokens)
    for a, b in zip(results, generate(target, requests[::-1], config)[::-1]):
        assert torch.equal(a.tokens, b.tokens)
