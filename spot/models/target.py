"""The native transformer behind the `spot.target.Target` interface.

Two attention regimes (docs/design.md §1.2):
- block-causal (SDAR, LLaDA2.0): each request keeps the exact KV cache of its final blocks.
  All windows of one request go into ONE row: a shared prefix of final-but-uncached blocks,
  then each candidate's own tokens; a token in block b attends the cache, and the tokens of
  blocks <= b of the prefix and of its own candidate (tree attention). Rows of different
  requests are padded, cache lengths may differ. The `keep` leading tokens of a window are
  final: their KV from this same forward is appended to the cache, so storing a finished
  block costs no pass of its own (it rides on the next block's first pass).
  With a prefix cache (`spot.models.prefix_cache`), a request opens with the KV of its
  prompt's longest cached whole-block prefix, the prompt prefixes that several requests opened
  together share and the cache lacks are computed once (`prefill_shared`), and a prompt's whole
  blocks go into the cache once computed.
- bidirectional (LLaDA, Dream): no cache; each window is one row holding the whole sequence
  (final tokens, the window, mask tokens up to the request's total length). No prefix cache
  either: a prompt's KV there depends on every token after it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

from spot.models.prefix_cache import PrefixCache
from spot.models.registry import Decoding, prefix_cache_problem
from spot.models.transformer import Transformer, block_causal_mask
from spot.target import Scores, Window


@dataclass
class CachedContext:
    """A block-causal request: KV of positions [0, length) per layer."""

    prompt: torch.Tensor  # [P]
    total_length: int
    length: int = 0
    keys: list[torch.Tensor] = field(default_factory=list)  # per layer [Hkv, total, D]
    values: list[torch.Tensor] = field(default_factory=list)  # per layer [Hkv, total, D]
    # where the prompt's whole blocks go once computed (positions [0, stored) are there)
    prefix_cache: PrefixCache | None = None
    stored: int = 0


@dataclass
class SequenceContext:
    """A bidirectional request: its final tokens, mask tokens elsewhere."""

    tokens: torch.Tensor  # [total_length]
    committed: int


@dataclass
class _Row:
    """One packed row of the block-causal batch."""

    tokens: torch.Tensor  # [L] long
    positions: torch.Tensor  # [L] long
    group: torch.Tensor  # [L] 0 = shared prefix, k + 1 = the row's k-th window
    outputs: list[torch.Tensor]  # per window: [B] row indices of its current block
    keep_index: torch.Tensor | None  # [keep] row indices of the tokens that become final


class DiffusionTarget:
    """A diffusion LM target: a native transformer plus its family's decoding traits."""

    def __init__(self, model: Transformer, decoding: Decoding):
        config = model.config
        self.model = model.eval()
        self.decoding = decoding
        self.mask_id = decoding.mask_id
        self.eos_ids = decoding.eos_ids
        self.vocab_size = config.vocab_size
        self.hidden_size = config.hidden_size
        self.absolute_block_grid = decoding.absolute_block_grid
        self.confidence = decoding.confidence
        self.opening_commit = decoding.opening_commit
        self.max_length = min(decoding.max_length, config.max_position_embeddings)
        self.block_causal = decoding.block_causal
        self.prefix_cache_problem = prefix_cache_problem(decoding.block_causal)
        parameter = next(model.parameters())
        self.device = parameter.device

    # -- Target protocol ---------------------------------------------------------------------
    def open(
        self, prompt: torch.Tensor, total_length: int, prefix_cache: PrefixCache | None = None
    ) -> CachedContext | SequenceContext:
        prompt = prompt.to(torch.long).cpu()
        if prompt.dim() != 1 or not 0 < prompt.numel() <= total_length:
            raise ValueError("a prompt is a non-empty 1-D token tensor within total_length")
        if total_length > self.max_length:
            raise ValueError(f"total length {total_length} > max_length {self.max_length}")
        if prefix_cache is not None and self.prefix_cache_problem is not None:
            raise ValueError(f"no prefix cache: {self.prefix_cache_problem}")
        if self.decoding.block_causal:
            context = CachedContext(prompt, total_length, prefix_cache=prefix_cache)
            if prefix_cache is not None:
                prefix_cache.claim(self)
                pieces = prefix_cache.lookup(prompt[: prefix_cache.cacheable(prompt.numel())])
                context.stored = sum(piece[0][0].shape[1] for piece in pieces)
                self._extend(context, pieces)
            return context
        tokens = torch.full((total_length,), self.mask_id, dtype=torch.long)
        tokens[: prompt.numel()] = prompt
        return SequenceContext(tokens, 0 if self.absolute_block_grid else prompt.numel())

    def committed_length(self, context: CachedContext | SequenceContext) -> int:
        if isinstance(context, CachedContext):
            return context.length
        return context.committed

    def score(
        self,
        contexts: Sequence[CachedContext | SequenceContext],
        windows: Sequence[Window],
        block_length: int,
        output_hidden: bool = False,
    ) -> Scores:
        _check_windows(contexts, windows, block_length, self.decoding.block_causal)
        with torch.inference_mode():
            if self.decoding.block_causal:
                return self._score_by_width(contexts, windows, block_length, output_hidden)
            return self._score_sequences(contexts, windows, block_length, output_hidden)

    def prefill_shared(self, contexts: Sequence[CachedContext]) -> list[int]:
        """Compute once the prompt prefixes that two or more of these just-opened contexts
        share beyond what they found in their prefix cache: one forward with one row per
        shared prefix (again while a longer one is shared), its KV copied into every context
        that shares it and stored in the cache. What only one context needs is left to its
        first `score`. Returns the positions computed in each context's name (a shared
        prefix's in its first context's)."""
        computed = [0] * len(contexts)
        with torch.inference_mode():
            while shared := _shared_prefixes(contexts):
                rows, firsts = [], []
                for members, end in shared:
                    first = contexts[members[0]]
                    span = torch.arange(first.length, end)
                    zeros = torch.zeros(span.numel(), dtype=torch.long)
                    rows.append(_Row(first.prompt[span], span, zeros, [zeros[:1]], span - span[0]))
                    firsts.append(first)
                    computed[members[0]] += span.numel()
                block_length = firsts[0].prefix_cache.block_length
                _, _, new_kv = self._forward_rows(firsts, rows, block_length, False)
                for r, (members, _) in enumerate(shared):
                    for m in members:
                        self._append_cache(contexts[m], new_kv, r, rows[r].keep_index)
        return computed

    def _score_by_width(self, contexts, windows, block_length, output_hidden) -> Scores:
        """Rows of one forward are padded to the widest. A request with final tokens still to
        cache (a prompt, a block just finished) has a row a prefix wider than the others, and
        on the CPU, where a forward costs what its tokens cost, padding included, the others
        would pay for that width: there the requests with a prefix and those without run as
        two forwards (continuous batching admits requests at any iteration, so at large batch
        sizes most forwards have such a row). On a GPU, where a forward's width is nearly
        free, one."""
        shortest = [0] * len(contexts)
        for w in windows:
            shortest[w.context] = min(shortest[w.context] or w.tokens.numel(), w.tokens.numel())
        prefixed = [n > block_length for n in shortest]  # its windows share the prefix
        if self.device.type != "cpu" or len(set(prefixed)) < 2:
            return self._score_cached(contexts, windows, block_length, output_hidden)
        logits: list[torch.Tensor] = [None] * len(windows)  # type: ignore[list-item]
        hidden: list[torch.Tensor] = [None] * len(windows)  # type: ignore[list-item]
        for flag in (True, False):
            group = [c for c in range(len(contexts)) if prefixed[c] == flag]
            local = {c: i for i, c in enumerate(group)}
            picked = [i for i, w in enumerate(windows) if w.context in local]
            part = self._score_cached(
                [contexts[c] for c in group],
                [replace(windows[i], context=local[windows[i].context]) for i in picked],
                block_length,
                output_hidden,
            )
            for j, i in enumerate(picked):
                logits[i] = part.logits[j]
                if part.hidden is not None:
                    hidden[i] = part.hidden[j]
        return Scores(torch.stack(logits), torch.stack(hidden) if output_hidden else None)

    def attention_mask(self, length: int, block_length: int) -> torch.Tensor | None:
        """The family's attention over a whole sequence of `length` (bool [1, 1, L, L], None =
        bidirectional), for full-recomputation references."""
        if self.decoding.block_causal:
            return block_causal_mask(length, block_length, self.device)
        return None

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Input embeddings [..., H] of tokens [...] (candidate-token features for drafters;
        plain tensors, not inference-mode ones, so drafter training can use them)."""
        with torch.no_grad():
            return self.model.embed(tokens.to(self.device))

    # -- bidirectional -----------------------------------------------------------------------
    def _score_sequences(self, contexts, windows, block_length, output_hidden) -> Scores:
        rows, outputs = [], []
        shift = 1 if self.decoding.logit_shift else 0
        for w in windows:
            ctx = contexts[w.context]
            seq = ctx.tokens.clone()
            end = ctx.committed + w.tokens.numel()
            seq[ctx.committed : end] = w.tokens
            rows.append(seq)
            # Dream: position p is predicted by hidden state p - 1 (position 0 by itself)
            outputs.append((torch.arange(end - block_length, end) - shift).clamp(min=0))
        lengths = torch.tensor([r.numel() for r in rows])
        width = int(lengths.max())
        tokens = torch.full((len(rows), width), self.mask_id, dtype=torch.long)
        for i, r in enumerate(rows):
            tokens[i, : r.numel()] = r
        positions = torch.arange(width).expand(len(rows), width)
        key_valid = torch.arange(width)[None, :] < lengths[:, None]  # [N, width]
        # [N, 1, 1, width]: every query the same keys; None (no padding) allows flash kernels
        mask = None if bool(key_valid.all()) else key_valid[:, None, None, :].to(self.device)
        logits, hidden, _ = self.model(
            tokens.to(self.device),
            positions.to(self.device),
            mask,
            output_hidden=output_hidden,
            logits_at=torch.stack(outputs).to(self.device),
        )
        for w in windows:
            if w.keep:
                ctx = contexts[w.context]
                ctx.tokens[ctx.committed : ctx.committed + w.keep] = w.tokens[: w.keep]
                ctx.committed += w.keep
        return Scores(logits, hidden)

    # -- block-causal ------------------------------------------------------------------------
    def _score_cached(self, contexts, windows, block_length, output_hidden) -> Scores:
        by_context: dict[int, list[int]] = {}
        for i, w in enumerate(windows):
            by_context.setdefault(w.context, []).append(i)
        order = list(by_context)
        rows = [
            _pack(contexts[c], [windows[i] for i in by_context[c]], block_length) for c in order
        ]
        in_order = [contexts[c] for c in order]
        logits, hidden, new_kv = self._forward_rows(in_order, rows, block_length, output_hidden)
        out_logits: list[torch.Tensor | None] = [None] * len(windows)
        out_hidden: list[torch.Tensor | None] = [None] * len(windows)
        for r, c in enumerate(order):
            for k, i in enumerate(by_context[c]):
                span = slice(k * block_length, (k + 1) * block_length)
                out_logits[i] = logits[r, span]
                if hidden is not None:
                    out_hidden[i] = hidden[r, span]
            if rows[r].keep_index is not None:
                self._append_cache(contexts[c], new_kv, r, rows[r].keep_index)
        return Scores(
            torch.stack(out_logits),
            torch.stack(out_hidden) if output_hidden else None,
        )

    def _forward_rows(
        self, contexts: list[CachedContext], rows: list[_Row], block_length: int, hidden: bool
    ):
        """One forward of packed rows, row r over the cache of contexts[r]: logits (and
        hidden) [R, S, ...] at each row's outputs in order, and the rows' new (k, v) per layer."""
        n, width = len(rows), max(r.tokens.numel() for r in rows)
        cached = torch.tensor([ctx.length for ctx in contexts])  # [R]
        past_width = int(cached.max())

        tokens = torch.full((n, width), self.mask_id, dtype=torch.long)
        positions = torch.zeros((n, width), dtype=torch.long)
        group = torch.full((n, width), -1, dtype=torch.long)
        for r, row in enumerate(rows):
            length = row.tokens.numel()
            tokens[r, :length] = row.tokens
            positions[r, :length] = row.positions
            group[r, :length] = row.group
        valid = group >= 0  # [R, width]
        block = positions // block_length
        same_candidate = (group[:, None, :] == 0) | (group[:, None, :] == group[:, :, None])
        new_mask = same_candidate & (block[:, None, :] <= block[:, :, None])
        new_mask &= valid[:, None, :] & valid[:, :, None]
        new_mask |= torch.eye(width, dtype=torch.bool)  # padding queries attend themselves
        past_mask = (torch.arange(past_width)[None, :] < cached[:, None])[:, None, :]
        past_mask = past_mask & valid[:, :, None]  # [R, width, past_width]
        mask = torch.cat([past_mask, new_mask], dim=-1)[:, None]  # [R, 1, width, past + width]

        past = self._gather_cache(contexts, past_width)
        outputs = [torch.cat(row.outputs) for row in rows]
        logits_at = torch.zeros((n, max(o.numel() for o in outputs)), dtype=torch.long)
        for r, flat in enumerate(outputs):
            logits_at[r, : flat.numel()] = flat
        return self.model(
            tokens.to(self.device),
            positions.to(self.device),
            mask.to(self.device),
            past_kv=past,
            output_hidden=hidden,
            logits_at=logits_at.to(self.device),
        )

    def _gather_cache(self, contexts: list[CachedContext], width: int):
        """Per layer (k, v) [R, Hkv, width, D]: each request's cache, then positions it has
        not filled (zeros, the mask hides them; its buffer is zero there until filled)."""
        if width == 0:
            return None
        template = next(ctx for ctx in contexts if ctx.length)
        past = []
        for layer in range(len(template.keys)):
            heads, _, dim = template.keys[layer].shape
            keys, values = [], []
            for ctx in contexts:
                if ctx.length and ctx.total_length >= width:
                    keys.append(ctx.keys[layer][:, :width])
                    values.append(ctx.values[layer][:, :width])
                    continue
                k = template.keys[layer].new_zeros((heads, width, dim))
                v = torch.zeros_like(k)
                if ctx.length:
                    k[:, : ctx.length] = ctx.keys[layer][:, : ctx.length]
                    v[:, : ctx.length] = ctx.values[layer][:, : ctx.length]
                keys.append(k)
                values.append(v)
            past.append((torch.stack(keys), torch.stack(values)))
        return past

    def _append_cache(self, ctx: CachedContext, new_kv, row: int, index: torch.Tensor) -> None:
        """Make the tokens at `index` of a forward's row final in `ctx`: their (k, v) from
        that forward, per layer [R, Hkv, L, D], go after its cache."""
        index = index.to(self.device)
        self._extend(ctx, [[(k[row, :, index], v[row, :, index]) for k, v in new_kv]])

    def _extend(self, ctx: CachedContext, pieces: list[list[tuple[torch.Tensor, torch.Tensor]]]):
        """Append KV pieces (each per layer (k, v) [Hkv, n, D]) to a context's cache; the
        prompt's whole blocks, once all there, go into its prefix cache."""
        for piece in pieces:
            end = ctx.length + piece[0][0].shape[1]
            for layer, (k, v) in enumerate(piece):
                if len(ctx.keys) <= layer:
                    shape = (k.shape[0], ctx.total_length, k.shape[2])
                    ctx.keys.append(k.new_zeros(shape))
                    ctx.values.append(v.new_zeros(shape))
                ctx.keys[layer][:, ctx.length : end] = k
                ctx.values[layer][:, ctx.length : end] = v
            ctx.length = end
        cache = ctx.prefix_cache
        if cache is not None:
            whole = min(ctx.length, cache.cacheable(ctx.prompt.numel()))
            if whole > ctx.stored:
                cache.insert(ctx.prompt[:whole], list(zip(ctx.keys, ctx.values)))
                ctx.stored = whole


def _pack(ctx: CachedContext, windows: list[Window], block_length: int) -> _Row:
    """One request's windows as one row: the longest block-aligned prefix they all share
    (never a window's current block), then each window's remaining tokens."""
    shortest = min(w.tokens.numel() for w in windows)
    shared = shortest - block_length
    first = windows[0].tokens
    for w in windows[1:]:
        differs = (w.tokens[:shared] != first[:shared]).nonzero()
        if differs.numel():
            shared = int(differs[0])
    shared = shared // block_length * block_length
    pieces, groups, outputs = [first[:shared]], [torch.zeros(shared, dtype=torch.long)], []
    keep_index = None
    offset = shared
    for k, w in enumerate(windows):
        own = w.tokens[shared:]
        pieces.append(own)
        groups.append(torch.full((own.numel(),), k + 1, dtype=torch.long))
        outputs.append(torch.arange(offset + own.numel() - block_length, offset + own.numel()))
        if w.keep:
            index = torch.arange(w.keep)
            keep_index = torch.where(index < shared, index, index - shared + offset)
        offset += own.numel()
    tokens = torch.cat(pieces)
    within = torch.cat(
        [torch.arange(shared)] + [torch.arange(shared, w.tokens.numel()) for w in windows]
    )
    return _Row(tokens, ctx.length + within, torch.cat(groups), outputs, keep_index)


def _shared_prefixes(contexts: Sequence[CachedContext]) -> list[tuple[list[int], int]]:
    """(contexts, end) for each prompt prefix that two or more contexts need next: those
    whose caches end at the same tokens and whose prompts go on with the same whole block,
    with the end of the whole blocks they all share."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, ctx in enumerate(contexts):
        cache = ctx.prefix_cache
        if cache is not None and ctx.length < cache.cacheable(ctx.prompt.numel()):
            key = tuple(ctx.prompt[: ctx.length + cache.block_length].tolist())
            groups.setdefault(key, []).append(i)
    shared = []
    for members in groups.values():
        if len(members) < 2:
            continue
        first = contexts[members[0]]
        block_length = first.prefix_cache.block_length
        end = min(first.prefix_cache.cacheable(contexts[m].prompt.numel()) for m in members)
        for m in members[1:]:
            differs = (contexts[m].prompt[:end] != first.prompt[:end]).nonzero()
            if differs.numel():
                end = int(differs[0]) // block_length * block_length
        shared.append((members, end))
    return shared


def _check_windows(contexts, windows, block_length: int, block_causal: bool) -> None:
    keeping: set[int] = set()
    if not windows:
        raise ValueError("nothing to score")
    for w in windows:
        if not 0 <= w.context < len(contexts):
            raise ValueError(f"window refers to context {w.context} of {len(contexts)}")
        ctx = contexts[w.context]
        size = w.tokens.numel()
        if size < block_length or (block_causal and size % block_length):
            raise ValueError(f"window of {size} tokens for block length {block_length}")
        if not 0 <= w.keep <= size - block_length:
            raise ValueError(f"keep {w.keep} would make the current block final")
        if block_causal and w.keep % block_length:
            raise ValueError("a block-causal target keeps whole blocks only")
        if w.keep and w.context in keeping:
            raise ValueError("at most one window per context may keep tokens")
        if w.keep:
            keeping.add(w.context)
        if block_causal:
            cache = ctx.prefix_cache
            if cache is not None and cache.block_length != block_length:
                raise ValueError(
                    f"block length {block_length} for a prefix cache of {cache.block_length}"
                )
            start, total = ctx.length, ctx.total_length
        else:
            start, total = ctx.committed, ctx.tokens.numel()
        if start + size > total:
            raise ValueError("window runs past the request's total length")
