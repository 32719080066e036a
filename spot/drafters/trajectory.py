"""Recording the target's own draft-free trajectories: what drafters learn or calibrate from.

One record per transition s_i -> s_{i+1} of the target's decoding (a `spot.decode.Trace`):
the target's exact distribution at s_i (top-k ids and log-probabilities per block position), which
positions were masked at s_i, and which committed, with which token. A *segment* is one block
of one request; its records are consecutive, so the state a few steps ahead of s_i is s_i's
mask minus the commits in between.

A recording is one file, or a folder of shard files (`shard-*.pt`, one per block of requests
a replica recorded); `Trajectories.load` reads either, a folder as the shards concatenated in
a canonical order (by request key, then step), so the same requests recorded in any number of
shards load as the same tensors.
"""

from __future__ import annotations

import io
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from spot import noise
from spot.drafters.order_model import stale_top
from spot.tree import State

TOP_K = 32
SHARD_PATTERN = "shard-*.pt"
_FIELDS = (
    "top_logprobs",
    "top_ids",
    "masked",
    "committed",
    "tokens",
    "segment",
    "block_step",
    "step",
    "key",
)


@dataclass(frozen=True)
class Trajectories:
    """Flat tensors over S recorded transitions of blocks of length B."""

    # [S, B, K] float32, untempered log-softmax, descending: the commit order among confident
    # positions rests on differences (1 - 3e-9 vs 1 - 8e-10) that probabilities in float32 erase
    top_logprobs: torch.Tensor
    top_ids: torch.Tensor  # [S, B, K] int32 token ids of top_logprobs
    masked: torch.Tensor  # [S, B] bool, masked at s_i
    committed: torch.Tensor  # [S, B] bool, committed in s_i -> s_{i+1}
    tokens: torch.Tensor  # [S, B] int32, the committed tokens (-1 elsewhere)
    segment: torch.Tensor  # [S] int32, one id per (request, block)
    block_step: torch.Tensor  # [S] int32, transitions already taken in the block
    step: torch.Tensor  # [S] int64, transitions already taken in the request (noise counter)
    key: torch.Tensor  # [S] int64, the request's coupled-noise key
    meta: dict
    hidden: torch.Tensor | None = None  # [S, B, H] float16 last hidden states at s_i

    @property
    def block_length(self) -> int:
        return self.masked.shape[1]

    def save(self, path: str | Path) -> None:
        """Write to `path` through a hidden temporary beside it, renamed when complete."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(f".{path.name}.partial")
        temporary.write_bytes(self.to_bytes())
        os.replace(temporary, path)

    def to_bytes(self) -> bytes:
        body = {name: getattr(self, name) for name in _FIELDS}
        buffer = io.BytesIO()
        torch.save(body | {"meta": self.meta, "hidden": self.hidden}, buffer)
        return buffer.getvalue()

    @classmethod
    def load(cls, path: str | Path) -> Trajectories:
        """One recording file, or a folder of shard files as one recording (see `concat`)."""
        path = Path(path)
        if not path.is_dir():
            return cls._load_file(path)
        shards = sorted(path.glob(SHARD_PATTERN))
        if not shards:
            raise ValueError(f"{path} holds no trajectory shards ({SHARD_PATTERN})")
        return cls.concat([cls._load_file(shard) for shard in shards], [s.name for s in shards])

    @classmethod
    def _load_file(cls, path: Path) -> Trajectories:
        body = torch.load(path, weights_only=True)
        if "top_logprobs" not in body:
            raise ValueError(
                f"{path} holds trajectories in an older format (probabilities, not "
                "log-probabilities); record them again with `spot-pipeline record-trajectories`"
            )
        return cls(**body)

    @classmethod
    def concat(cls, parts: Sequence[Trajectories], names: Sequence[str] = ()) -> Trajectories:
        """One recording of the requests of `parts` (shards of one recording: same decoding,
        no request in two of them), in canonical order: by request key, then step, segments
        numbered in that order. Its `requests` is the parts' total."""
        names = list(names) or [f"part {i}" for i in range(len(parts))]
        first = parts[0].meta
        for part, name in zip(parts, names):
            differ = sorted(
                k for k in {*first, *part.meta} - {"requests"} if first.get(k) != part.meta.get(k)
            )
            if differ:
                raise ValueError(
                    f"{name} was recorded with another {', '.join(differ)} than {names[0]}: "
                    "shards of one recording share their decoding"
                )
            if (part.hidden is None) != (parts[0].hidden is None):
                raise ValueError(f"{name} and {names[0]}: only one of them has hidden states")
        owner: dict[int, str] = {}
        for part, name in zip(parts, names):
            for key in part.key.unique().tolist():
                if owner.setdefault(key, name) != name:
                    raise ValueError(f"request key {key} is recorded in {owner[key]} and {name}")
        hidden = None if parts[0].hidden is None else torch.cat([p.hidden for p in parts])
        joined = cls(
            **{n: torch.cat([getattr(p, n) for p in parts]) for n in _FIELDS},
            meta=first | {"requests": sum(int(p.meta["requests"]) for p in parts)},
            hidden=hidden,
        )
        return joined.canonical()

    def canonical(self) -> Trajectories:
        """The same records ordered by (request key, step), segments renumbered in that
        order: how a recording compares to the same requests recorded in other batches or
        shards."""
        order = torch.argsort(self.step, stable=True)
        order = order[torch.argsort(self.key[order], stable=True)]
        ordered = self._select(order)
        # a block of a request is one segment (of one part: no request is in two), so a new
        # segment begins where the request or its part's segment id changes
        starts = torch.ones_like(ordered.segment, dtype=torch.bool)
        starts[1:] = (ordered.key[1:] != ordered.key[:-1]) | (
            ordered.segment[1:] != ordered.segment[:-1]
        )
        return Trajectories(
            **{n: getattr(ordered, n) for n in _FIELDS if n != "segment"},
            segment=(torch.cumsum(starts, 0) - 1).to(torch.int32),
            meta=self.meta,
            hidden=ordered.hidden,
        )

    def split(self, fraction: float) -> tuple[Trajectories, Trajectories]:
        """(train, held-out) by segment, the last `fraction` of segments held out."""
        segments = self.segment.unique()
        cut = segments[int(len(segments) * (1 - fraction))]
        keep = self.segment < cut
        return self._select(keep), self._select(~keep)

    def of_requests(self, keys: Iterable[int]) -> Trajectories:
        """The records of the requests whose noise keys are in `keys`, in this order."""
        wanted = torch.tensor(sorted(set(keys)), dtype=self.key.dtype)
        return self._select(torch.isin(self.key, wanted))

    def _select(self, rows: torch.Tensor) -> Trajectories:
        hidden = None if self.hidden is None else self.hidden[rows]
        return Trajectories(
            **{n: getattr(self, n)[rows] for n in _FIELDS}, meta=self.meta, hidden=hidden
        )


class TrajectoryRecorder:
    """A `spot.decode.Trace` that keeps what drafters need; `result()` stacks it."""

    def __init__(
        self,
        keys: list[int] | dict[int, int],
        block_length: int,
        mask_id: int,
        top_k: int = TOP_K,
        record_hidden: bool = False,
    ):
        self.needs_hidden = record_hidden
        # noise key of each request index of the current generate() call (or stream)
        self.keys = keys
        self.block_length = block_length
        self.mask_id = mask_id
        self.top_k = top_k
        self._rows: list[tuple] = []
        self._segments: dict[tuple[int, int], int] = {}

    def __call__(self, index, state: State, logits: torch.Tensor, successor: State, hidden) -> None:
        b = self.block_length
        width = state.span.numel()
        before = state.block(b)
        after = successor.span[width - b : width]
        top_logprobs, top_ids = stale_top(logits, self.top_k)
        masked = before == self.mask_id
        committed = masked & (after != self.mask_id)
        tokens = torch.where(committed, after, torch.full_like(after, -1))
        key = (self.keys[index], state.block_start(b))
        segment = self._segments.setdefault(key, len(self._segments))
        self._rows.append(
            (
                top_logprobs.cpu(),
                top_ids.to(torch.int32).cpu(),
                masked.cpu(),
                committed.cpu(),
                tokens.to(torch.int32).cpu(),
                segment,
                state.block_step,
                state.step,
                self.keys[index],
                None if hidden is None else hidden.to(torch.float16).cpu(),
            )
        )

    def result(self, meta: dict) -> Trajectories:
        """All records, each segment's consecutive and in step order; `meta` (the decoding
        they were recorded with) gains the noise generator that decoding drew from."""
        return self._stacked(self._rows, meta)

    def take(self, keys: Iterable[int], meta: dict) -> Trajectories | None:
        """The records of the requests with these noise keys (rows that finished, while
        others still decode), as `result` stacks them, and forgets them; None if it holds
        none of them."""
        wanted = set(keys)
        taken = [row for row in self._rows if row[8] in wanted]
        if not taken:
            return None
        self._rows = [row for row in self._rows if row[8] not in wanted]
        return self._stacked(taken, meta)

    def _stacked(self, rows: list[tuple], meta: dict) -> Trajectories:
        rows = sorted(rows, key=lambda r: (r[5], r[6]))
        cols = list(zip(*rows))
        return Trajectories(
            top_logprobs=torch.stack(cols[0]),
            top_ids=torch.stack(cols[1]),
            masked=torch.stack(cols[2]),
            committed=torch.stack(cols[3]),
            tokens=torch.stack(cols[4]),
            segment=torch.tensor(cols[5], dtype=torch.int32),
            block_step=torch.tensor(cols[6], dtype=torch.int32),
            step=torch.tensor(cols[7], dtype=torch.int64),
            key=torch.tensor(cols[8], dtype=torch.int64),
            hidden=torch.stack(cols[9]) if self.needs_hidden else None,
            meta=meta | {"noise": noise.GENERATOR},
        )
