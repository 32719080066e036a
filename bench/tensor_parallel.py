"""TP 2 against TP 1 on the bundled targets: how many completions a target sharded over two
DeepSpeed ranks (CPU, gloo) decodes token for token like the unsharded target, per dtype,
temperature and drafter, on the held-out prompts. float32 and bfloat16 only: DeepSpeed shards
no float64. Where TP changes the arithmetic (split sums, the all-reduce), a near tie can fall
the other way; this counts how often it does.

    .venv/bin/python bench/tensor_parallel.py --prompts 32 --gen-length 64

This process is rank 0 and starts rank 1; OMP_NUM_THREADS=1 per rank on a small machine.
"""

from __future__ import annotations

import argparse
import time

import torch

from pipeline.drafter_data import corpus_prompts, encode, load_model_and_tokenizer
from spot.builtin import builtin_drafter, resolve_builtin
from spot.config import DecodingConfig
from spot.decode import generate
from spot.drafters.registry import load_drafter
from spot.models.tensor_parallel import GroupSpec, ModelSpec, TensorParallelGroup
from spot.target import Window


def max_logit_diff(plain, sharded, prompt: torch.Tensor, block_length: int) -> float:
    """Largest |TP 1 - TP 2| logit over a block of masks and a block of prompt tokens."""
    mask = torch.full((block_length,), plain.mask_id)
    windows = [Window(0, mask), Window(0, prompt[:block_length].clone())]
    logits = []
    for target in (plain, sharded):
        context = target.open(prompt, len(prompt) + block_length)
        logits.append(target.score([context], windows, block_length).logits.double())
    return float((logits[0] - logits[1]).abs().max())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--targets", default="sdar-nano,sdar-tiny,llada-tiny")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--gen-length", type=int, default=64)
    parser.add_argument("--block-length", type=int, default=16)
    args = parser.parse_args()

    group = TensorParallelGroup(GroupSpec(degree=2))
    prompts = corpus_prompts("heldout", args.prompts)
    print("| target | dtype | max logit diff | T | drafter | same completions | same tokens |")
    print("|---|---|---|---|---|---|---|")
    for name in args.targets.split(","):
        path = str(resolve_builtin(f"builtin:{name}"))
        spot = builtin_drafter(name, "spot", args.block_length, "static")
        for dtype in args.dtypes.split(","):
            started = time.perf_counter()
            tokenizer, plain = load_model_and_tokenizer(path, dtype)
            sharded = group.load(ModelSpec(path, None, dtype))
            requests = encode(tokenizer, prompts)
            diff = max_logit_diff(plain, sharded, requests[0].prompt, args.block_length)
            for temperature in (0.0, 0.8):
                config = DecodingConfig(
                    gen_length=args.gen_length,
                    block_length=args.block_length,
                    temperature=temperature,
                    seed=3,
                )
                for drafter in ("none", "spot"):
                    outputs = []
                    for target in (plain, sharded):
                        made = load_drafter("spot", spot, 8, target) if drafter == "spot" else None
                        results = generate(target, encode(tokenizer, prompts), config, made)
                        outputs.append([r.tokens.tolist() for r in results])
                    pairs = list(zip(*outputs, strict=True))
                    same = sum(a == b for a, b in pairs)
                    tokens = sum(len(a) for a, _ in pairs)
                    same_tokens = sum(x == y for a, b in pairs for x, y in zip(a, b))
                    print(
                        f"| {name} | {dtype} | {diff:.1e} | {temperature} | {drafter} | "
                        f"{same}/{len(pairs)} | {same_tokens}/{tokens} |",
                        flush=True,
                    )
            print(f"<!-- {name} {dtype}: {time.perf_counter() - started:.0f} s -->", flush=True)
    group.close()


if __name__ == "__main__":
    main()
