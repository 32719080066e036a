"""Training batches see exactly what decoding sees; the train-target command runs end to end."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from pydantic import ValidationError

from spot.config import DecodingConfig
from spot.decode import Request, generate
from spot.models.loading import load_target
from spot.models.transformer import Transformer, TransformerConfig, block_causal_mask
from spot_factory.train_target import (
    PRESETS,
    Architecture,
    SpecialIds,
    TrainSpec,
    init_model,
    llada_batch,
    sdar_batch,
    train,
    train_target_command,
)

IDS = SpecialIds(mask=3, eos=0, im_end=2)


def _rows(generator: torch.Generator, count: int) -> list[tuple[list[int], list[int]]]:
    rows = []
    for _ in range(count):
        p = int(torch.randint(5, 40, (1,), generator=generator))
        a = int(torch.randint(3, 30, (1,), generator=generator))
        prompt = torch.randint(4, 50, (p,), generator=generator).tolist()
        answer = torch.randint(4, 50, (a,), generator=generator).tolist() + [IDS.im_end]
        rows.append((prompt, answer))
    return rows


def _tiny_model(seed: int = 0) -> Transformer:
    config = TransformerConfig(
        vocab_size=50, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=8, qk_norm=True,
    )  # fmt: skip
    return init_model(config, "sdar", torch.Generator().manual_seed(seed)).double().eval()


def test_sdar_noised_block_sees_clean_prefix_and_itself_only():
    """Each noised block's logits in the packed batch equal a from-scratch forward over the
    clean blocks before it followed by that noised block, with block-causal attention (what
    the decoder computes over its KV cache)."""
    g = torch.Generator().manual_seed(0)
    rows = _rows(g, 3)
    model = _tiny_model()
    for block in (8, 16):
        batch = sdar_batch(rows, block, 2, IDS, g)
        logits, _, _ = model(batch.input_ids, batch.position_ids, batch.attention_mask)
        for i, (prompt, answer) in enumerate(rows):
            context = int(batch.logits_at[i, 0])  # the clean part comes first
            clean = batch.input_ids[i, :context]
            end = -(-(len(prompt) + len(answer)) // block) * block
            slots = 2 * (end - len(prompt) // block * block)
            for s in range(0, slots, block):
                at = int(batch.logits_at[i, s])
                position = int(batch.position_ids[i, at])
                noised = batch.input_ids[i, at : at + block]
                seq = torch.cat([clean[:position], noised])[None]
                mask = block_causal_mask(seq.shape[1], block)
                expected = model.full_logits(seq, mask)[0, position:]
                torch.testing.assert_close(logits[i, at : at + block], expected)


def test_sdar_masks_only_answer_positions_and_targets_the_clean_tokens():
    g = torch.Generator().manual_seed(1)
    rows = _rows(g, 8)
    batch = sdar_batch(rows, 16, 3, IDS, g)
    assert batch.attention_mask.shape[0] == len(rows)
    masked_count = 0
    for i, (prompt, answer) in enumerate(rows):
        end = -(-(len(prompt) + len(answer)) // 16) * 16
        slots = batch.logits_at[i, : 3 * (end - len(prompt) // 16 * 16)]
        picked = batch.input_ids[i, slots]
        positions = batch.position_ids[i, slots]
        targets = batch.targets[i, : slots.numel()]
        has_loss = targets != -100
        assert bool((batch.targets[i, slots.numel() :] == -100).all())
        assert bool(((picked == IDS.mask) == has_loss).all())
        # losses on the answer, then EOS to the end of its block (where SDAR decoding stops)
        assert int(positions[has_loss].min()) >= len(prompt)
        assert int(positions.max()) < end
        sequence = prompt + answer + [IDS.eos] * (end - len(prompt) - len(answer))
        for p, t in zip(positions[has_loss].tolist(), targets[has_loss].tolist()):
            assert sequence[p] == t
        masked_count += int(has_loss.sum())
    ratio = masked_count / sum(len(a) for _, a in rows) / 3
    assert 0.2 < ratio < 0.9


def test_llada_prompt_stays_clean_and_semi_autoregressive_rows_mask_later_blocks():
    g = torch.Generator().manual_seed(2)
    rows = _rows(g, 64)
    batch = llada_batch(rows, 64, (16, 32), IDS, g)
    for i, (prompt, _) in enumerate(rows):
        assert batch.input_ids[i, : len(prompt)].tolist() == prompt
        region = batch.input_ids[i, len(prompt) : len(prompt) + 64]
        assert bool(((region == IDS.mask) == (batch.targets[i] != -100)).all())
        assert bool(batch.attention_mask[i, 0, 0, : len(prompt) + 64].all())
        assert not bool(batch.attention_mask[i, 0, 0, len(prompt) + 64 :].any())
    masked = batch.targets != -100
    last_blocks_full = masked[:, 32:].all(dim=1) & ~masked[:, :16].any(dim=1)
    assert int(last_blocks_full.sum()) > 0  # semi-autoregressive rows exist


def _smoke_spec(family: str) -> TrainSpec:
    return TrainSpec(
        name=f"{family}-smoke",
        family=family,
        architecture=Architecture(
            hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, num_kv_heads=1
        ),
        steps=4,
        batch_size=4,
        warmup_steps=2,
    )


def test_train_saves_a_loadable_checkpoint_that_decodes(tmp_path):
    for family in ("sdar", "llada"):
        out = train(_smoke_spec(family), tmp_path / family, progress=False)
        log = [json.loads(line) for line in (out / "loss_log.jsonl").read_text().splitlines()]
        assert [r["step"] for r in log] == [1, 2, 3, 4]
        assert all(r["loss"] > 0 for r in log)
        config = json.loads((out / "config.json").read_text())
        assert config["model_type"] == family and config["torch_dtype"] == "bfloat16"
        assert (out / "tokenizer.json").is_file() and (out / "README.md").is_file()
        target = load_target(out, dtype=torch.float32)
        assert target.mask_id == 3 and set(target.eos_ids) == {0, 2}
        decoding = DecodingConfig(gen_length=32, block_length=16)
        (result,) = generate(target, [Request(torch.tensor([1, 5, 6, 7, 2]), 0)], decoding)
        assert result.tokens.numel() >= 32


def test_train_target_command_with_overrides(tmp_path):
    out = tmp_path / "nano"
    result = CliRunner().invoke(
        train_target_command,
        ["sdar-nano", "--output", str(out), "--steps", "2", "--batch-size", "2"],
    )
    assert result.exit_code == 0, result.output
    meta = json.loads((out / "training.json").read_text())
    assert meta["spec"]["steps"] == 2 and meta["spec"]["batch_size"] == 2
    assert meta["spec"]["architecture"] == PRESETS["sdar-nano"].architecture.model_dump()


def test_only_families_that_train_from_scratch_are_accepted():
    trainable = r"'dream' is not trained here; trainable: \['llada', 'sdar'\]"
    with pytest.raises(ValidationError, match=trainable):
        _smoke_spec("dream")
