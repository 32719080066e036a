"""Drafters learned from the target's own decoding of prompts unlike the bundled corpus.

record: decode rows of the off-corpus stream (`bench/offcorpus_prompts.py`) draft-free and
keep their trajectories, one shard per `--chunk` rows (resumable: shards already there are
kept).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from offcorpus_prompts import SEED, offcorpus_prompts  # noqa: E402

from pipeline.drafter_data import encode, load_model_and_tokenizer  # noqa: E402
from spot.config import DecodingConfig  # noqa: E402
from spot.decode import generate  # noqa: E402
from spot.drafters.recipes import recording_meta  # noqa: E402
from spot.drafters.trajectory import Trajectories, TrajectoryRecorder  # noqa: E402


def decoding(args) -> DecodingConfig:
    return DecodingConfig(
        gen_length=args.gen_length, block_length=args.block_length, temperature=args.temperature
    )


def shard_path(folder: Path, start: int, stop: int) -> Path:
    return folder / f"rows-{start:06d}-{stop:06d}.pt"


def record(args) -> None:
    tokenizer, target = load_model_and_tokenizer(f"builtin:{args.target}")
    config = decoding(args)
    folder = Path(args.out_dir)
    for start in range(args.start, args.stop, args.chunk):
        stop = min(args.stop, start + args.chunk)
        path = shard_path(folder, start, stop)
        if path.exists():
            continue
        t0 = time.perf_counter()
        requests = encode(tokenizer, offcorpus_prompts(stop - start, args.seed, skip=start))
        keys = [r.key for r in requests]
        recorder = TrajectoryRecorder(keys, config.block_length, target.mask_id)
        generate(target, requests, config, trace=recorder, max_active=args.batch_size)
        meta = recording_meta(config, target, len(requests))
        prompts = f"offcorpus seed {args.seed}"
        traj = recorder.result(meta | {"model": f"builtin:{args.target}", "prompts": prompts})
        traj.save(path)
        print(
            f"rows {start}-{stop}: {traj.segment.numel()} records, "
            f"{time.perf_counter() - t0:.0f} s -> {path}",
            flush=True,
        )


def load_rows(folder: str | Path, stop: int, start: int = 0) -> Trajectories:
    """The recorded shards of rows [start, stop) as one recording."""
    paths = sorted(Path(folder).glob("rows-*.pt"))
    chosen = [p for p in paths if start <= int(p.stem.split("-")[1]) < stop]
    return Trajectories.concat([Trajectories.load(p) for p in chosen], [p.name for p in chosen])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record")
    rec.add_argument("--target", default="sdar-tiny")
    rec.add_argument("--start", type=int, default=0)
    rec.add_argument("--stop", type=int, default=4800)
    rec.add_argument("--chunk", type=int, default=200)
    rec.add_argument("--batch-size", type=int, default=16)
    rec.add_argument("--seed", type=int, default=SEED)
    rec.add_argument("--out-dir", required=True)
    for q in (rec,):
        q.add_argument("--block-length", type=int, default=32)
        q.add_argument("--gen-length", type=int, default=64)
        q.add_argument("--temperature", type=float, default=0.0)
    args = p.parse_args()
    torch.set_grad_enabled(False)
    {"record": record}[args.command](args)


if __name__ == "__main__":
    main()
