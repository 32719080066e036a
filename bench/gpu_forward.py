"""Cost of one target forward as the verified tree grows, at real 8B dimensions, on a GPU.

    .venv/bin/python bench/gpu_forward.py                      # SDAR-8B and LLaDA-8B, bf16
    .venv/bin/python bench/gpu_forward.py --steps-per-forward 1:1,4:2.1,16:3.0,64:3.6
    .venv/bin/python bench/gpu_forward.py --tiny               # CPU smoke test, seconds

Random bf16 weights with the architectures of the reference configs (tests/
reference_checkpoints/*/config.json): the cost of a forward does not depend on the weights.
Each request has a prefix of 512 final tokens (SDAR: in the exact KV cache; LLaDA:
recomputed, it has no cache) and a tree of N candidate blocks of 32; N grows 1..64, at batch 1
and the pipeline's batch sizes. Per row: milliseconds per forward, the cost relative to N=1
(the steps per forward a tree of N nodes must advance to pay for itself), and, given the
drafter's measured steps per forward at N (`--steps-per-forward N:s,...`, or `--drafter`
with its stored acceptance curve), the implied tokens per second (one token per step) and
speed-up over draft-free decoding (one step per forward at N=1). Runs inside `--time-limit`
seconds (default 480): configurations that do not fit in it, or in `--max-tokens` query
tokens per forward, are listed as skipped.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from spot.models.registry import family_for
from spot.models.target import DiffusionTarget
from spot.models.transformer import TransformerConfig
from spot.target import Window

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "tests" / "reference_checkpoints"
MODELS = {"sdar-8b": "sdar-8b-chat", "llada-8b": "llada-8b-instruct"}
NODES = (1, 2, 4, 8, 16, 32, 64)
BATCHES = (1, 8, 32)


def random_target(family: str, config: TransformerConfig, dtype, device) -> DiffusionTarget:
    """The family's native model with N(0, 0.02) weights (unit norms), on `device`."""
    fam = family_for(family)
    with torch.device("meta"):
        model = fam.build(config)
    model = model.to_empty(device=device).to(dtype)  # never the float32 copy of 8B weights
    generator = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=generator)
        for buffer in model.buffers():
            buffer.zero_()
    mask_id = config.vocab_size - 1
    raw = {
        "mask_token_id": mask_id,
        "eos_token_id": mask_id - 1,
        "max_position_embeddings": config.max_position_embeddings,
        "max_sequence_length": config.max_position_embeddings,
    }
    decoding = fam.decoding(raw, {}, ())
    return DiffusionTarget(model.eval(), decoding)


def time_forward(
    target: DiffusionTarget,
    batch: int,
    nodes: int,
    prefix: int,
    block: int,
    repeats: int,
    synchronize,
) -> float:
    """Median seconds of one `score` of `batch` requests x `nodes` candidate blocks each."""
    generator = torch.Generator().manual_seed(batch * 1000 + nodes)
    contexts = []
    for _ in range(batch):
        prompt = torch.randint(0, target.mask_id, (prefix,), generator=generator)
        context = target.open(prompt, prefix + block)
        pending = prompt[target.committed_length(context) :]
        if target.decoding.block_causal and pending.numel():
            # write the prefix into the exact KV cache, as the decode loop's first pass does
            blank = torch.full((block,), target.mask_id)
            target.score([context], [Window(0, torch.cat([pending, blank]), prefix)], block)
        contexts.append(context)
    windows = []
    for c in range(batch):
        for n in range(nodes):
            tokens = torch.full((block,), target.mask_id)
            tokens[: n % block] = torch.randint(
                0, target.mask_id, (n % block,), generator=generator
            )
            windows.append(Window(c, tokens))
    target.score(contexts, windows, block)  # warm-up
    synchronize()
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        target.score(contexts, windows, block)
        synchronize()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def query_tokens(block_causal: bool, batch: int, nodes: int, prefix: int, block: int) -> int:
    """Tokens one forward computes: cached targets only the candidate blocks, bidirectional
    ones the whole sequence per candidate."""
    per_node = block if block_causal else prefix + block
    return batch * nodes * per_node


def parse_curve(text: str | None, drafter: str | None) -> dict[int, float]:
    """Steps per forward by tree size N (nodes, root included)."""
    if text:
        pairs = (item.split(":") for item in text.split(","))
        return {int(n): float(s) for n, s in pairs}
    if drafter:
        from spot.drafters.files import read_header

        curve = read_header(drafter)["acceptance_curve"]
        return {b + 1: s for b, s in zip(curve["budgets"], curve["steps_per_forward"])}
    return {}


def tiny_config(family: str) -> TransformerConfig:
    kv = 4 if family == "llada" else 2
    return TransformerConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=kv,
        head_dim=16,
        qk_norm=family == "sdar",
        max_position_embeddings=4096,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--configs", default=str(CONFIGS), help="reference-checkpoints folder")
    parser.add_argument("--nodes", default=",".join(map(str, NODES)))
    parser.add_argument("--batches", default=",".join(map(str, BATCHES)))
    parser.add_argument("--prefix", type=int, default=512)
    parser.add_argument("--block", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=200_000)
    parser.add_argument("--time-limit", type=float, default=480.0)
    parser.add_argument("--steps-per-forward", default=None, help="N:steps,... of a drafter")
    parser.add_argument("--drafter", default=None, help="a drafter file with an acceptance curve")
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    parser.add_argument("--tiny", action="store_true", help="tiny models on CPU (smoke test)")
    args = parser.parse_args()

    start = time.perf_counter()
    nodes = [int(x) for x in args.nodes.split(",")]
    batches = [int(x) for x in args.batches.split(",")]
    curve = parse_curve(args.steps_per_forward, args.drafter)
    if args.tiny:
        device, dtype, prefix, block = torch.device("cpu"), torch.float32, 16, 4
        nodes, batches = [n for n in nodes if n <= 4], [1, 2]
    else:
        if not torch.cuda.is_available():
            raise SystemExit("no GPU: run with --tiny for a CPU smoke test")
        device, dtype, prefix, block = torch.device("cuda"), torch.bfloat16, args.prefix, args.block
    synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    label = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"device {label}, {dtype}, prefix {prefix}, block {block}, repeats {args.repeats}")

    rows, skipped = [], []
    for name in args.models.split(","):
        family = family_for(None, {"model_type": name.split("-")[0]}).name
        if args.tiny:
            config = tiny_config(family)
        else:
            raw = json.loads((Path(args.configs) / MODELS[name] / "config.json").read_text())
            config = family_for(family, raw).native_config(raw)
        target = random_target(family, config, dtype, device)
        size = sum(p.numel() for p in target.model.parameters())
        print(f"\n{family}-tiny: {size:,} params" if args.tiny else f"\n{name}: {size / 1e9:.2f}B")
        print(
            f"{'batch':>5} {'nodes':>5} {'tokens':>8} {'ms':>9} {'x N=1':>6} "
            f"{'steps/fw':>8} {'tok/s':>9} {'speed-up':>8}"
        )
        for batch in batches:
            base = None
            for n in nodes:
                tokens = query_tokens(target.decoding.block_causal, batch, n, prefix, block)
                if tokens > args.max_tokens or time.perf_counter() - start > args.time_limit:
                    skipped.append((name, batch, n, tokens))
                    continue
                seconds = time_forward(target, batch, n, prefix, block, args.repeats, synchronize)
                base = base or (seconds if n == 1 else None)
                relative = seconds / base if base else float("nan")
                steps = curve.get(n)
                rate = batch * steps / seconds if steps else None  # tokens/s at 1 token/step
                speedup = steps / relative if steps and base else None
                rows.append(
                    {
                        "model": name,
                        "batch": batch,
                        "nodes": n,
                        "tokens": tokens,
                        "seconds": seconds,
                        "relative": relative,
                        "steps_per_forward": steps,
                        "tokens_per_second": rate,
                        "speedup": speedup,
                    }
                )
                print(
                    f"{batch:>5} {n:>5} {tokens:>8} {seconds * 1e3:>9.2f} {relative:>6.2f} "
                    f"{'-' if steps is None else f'{steps:.2f}':>8} "
                    f"{'-' if rate is None else f'{rate:.0f}':>9} "
                    f"{'-' if speedup is None else f'{speedup:.2f}x':>8}"
                )
        del target
        if device.type == "cuda":
            torch.cuda.empty_cache()
    for name, batch, n, tokens in skipped:
        print(f"skipped {name} batch {batch} nodes {n} ({tokens} query tokens)")
    print(f"total {time.perf_counter() - start:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "skipped": skipped}, indent=1))


if __name__ == "__main__":
    main()
