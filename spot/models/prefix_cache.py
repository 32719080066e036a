"""Prompt prefixes whose keys and values are computed once per replica (docs/design.md §1.2).

On a block-causal target (SDAR, LLaDA2.0) a block attends itself and the blocks before it,
never what follows, so the KV of positions [0, n), n on the block grid, depends on the tokens
[0, n) alone: a prompt's whole blocks (those before its last, partial block, which is decoded
as the first block) have the same KV in every request that starts with them. The cache keeps
them in a radix tree of whole blocks (an edge holds one or more blocks and their KV on the
target's device; an edge splits where two prompts part), so a system prompt in front of
millions of rows is stored once and computed once.

It is a value its owner (the engine of one replica) creates with a byte budget and passes to
`spot.decode.stream`; the least recently used leaves go when the budget is exceeded. A request
that took KV from it keeps its own copy, so evicting never changes a request being decoded.
The KV depends on the block grid, so a cache serves one block length, and on the weights, so
it serves the one target that first uses it.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch

LayerKV = tuple[torch.Tensor, torch.Tensor]  # (k, v) [Hkv, n, D] of n consecutive positions


@dataclass
class PrefixCacheStats:
    """What a cache did since it was made."""

    lookups: int = 0  # prompts looked up
    hits: int = 0  # lookups that found at least one block
    tokens_reused: int = 0  # positions whose KV a lookup returned
    tokens_stored: int = 0  # positions whose KV was put in the cache
    tokens_evicted: int = 0  # positions whose KV left it for the budget
    bytes: int = 0  # held now
    nodes: int = 0  # edges held now

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0


class _Node:
    """An edge of the tree: whole blocks of tokens and their KV per layer."""

    __slots__ = ("tokens", "kv", "children", "parent", "used")

    def __init__(self, tokens: torch.Tensor, kv: list[LayerKV], parent: _Node | None):
        self.tokens = tokens  # [n] long, on the CPU; n a multiple of the block length
        self.kv = kv  # per layer (k, v) [Hkv, n, D], on the target's device
        self.children: dict[tuple[int, ...], _Node] = {}  # by the tokens of their first block
        self.parent = parent
        self.used = 0  # the cache's clock when last looked up or stored

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.kv)


class PrefixCache:
    """KV of prompt prefixes in whole blocks of `block_length`, at most `budget_bytes` of it."""

    def __init__(self, budget_bytes: int, block_length: int):
        if budget_bytes < 0:
            raise ValueError(f"prefix cache budget_bytes must be >= 0, not {budget_bytes}")
        if block_length <= 0:
            raise ValueError(f"prefix cache block_length must be positive, not {block_length}")
        self.budget_bytes = budget_bytes
        self.block_length = block_length
        self.stats = PrefixCacheStats()
        self._root = _Node(torch.zeros(0, dtype=torch.long), [], None)
        self._clock = 0
        self._owner: weakref.ref | None = None

    def claim(self, owner: object) -> None:
        """Bind the cache to the target whose KV it holds (the first one to use it)."""
        if self._owner is None:
            self._owner = weakref.ref(owner)
        elif self._owner() is not owner:
            raise ValueError("a prefix cache holds one target's KV; this one serves another")

    def cacheable(self, prompt_length: int) -> int:
        """How many leading positions of a prompt can be cached: its whole blocks."""
        return prompt_length // self.block_length * self.block_length

    def lookup(self, tokens: torch.Tensor) -> list[list[LayerKV]]:
        """The KV of the longest cached prefix of `tokens` [n] in whole blocks, as pieces
        (each per layer (k, v) [Hkv, m, D], views into the cache) in position order."""
        self.stats.lookups += 1
        pieces = []
        found = 0
        for node, blocks in self._walk(tokens):
            self._touch(node)
            size = blocks * self.block_length
            pieces.append([(k[:, :size], v[:, :size]) for k, v in node.kv])
            found += size
        if found:
            self.stats.hits += 1
            self.stats.tokens_reused += found
        return pieces

    def insert(self, tokens: torch.Tensor, kv: Sequence[LayerKV]) -> None:
        """Store the KV of `tokens` [n] (n on the block grid), given per layer as
        (k, v) [Hkv, >= n, D] of positions 0.., copying the part the cache lacks; then evict
        least recently used leaves down to the budget."""
        n = tokens.numel()
        if n % self.block_length:
            raise ValueError(f"a cached prefix is whole blocks, not {n} tokens")
        node, start = self._root, 0
        for child, blocks in self._walk(tokens):
            self._touch(child)
            size = blocks * self.block_length
            if size < child.tokens.numel():
                child = self._split(child, size)
            node, start = child, start + size
        if start < n:
            leaf = _Node(
                tokens[start:n].clone(),
                [(k[:, start:n].clone(), v[:, start:n].clone()) for k, v in kv],
                node,
            )
            node.children[self._key(leaf.tokens, 0)] = leaf
            self._touch(leaf)
            self.stats.tokens_stored += n - start
            self.stats.bytes += leaf.nbytes
            self.stats.nodes += 1
        self._evict()

    # -- the tree ------------------------------------------------------------------------------
    def _key(self, tokens: torch.Tensor, start: int) -> tuple[int, ...]:
        return tuple(tokens[start : start + self.block_length].tolist())

    def _walk(self, tokens: torch.Tensor):
        """(edge, matching whole blocks) along the longest cached prefix of `tokens`; only
        the last edge may match partly."""
        b = self.block_length
        node, start = self._root, 0
        while start + b <= tokens.numel():
            child = node.children.get(self._key(tokens, start))
            if child is None:
                return
            edge = child.tokens
            span = min(edge.numel(), (tokens.numel() - start) // b * b)
            differs = (edge[:span] != tokens[start : start + span]).nonzero()
            matched = span if not differs.numel() else int(differs[0]) // b * b
            yield child, matched // b
            if matched < edge.numel():
                return
            node, start = child, start + matched

    def _split(self, node: _Node, size: int) -> _Node:
        """Cut an edge after `size` tokens; the upper part (returned) takes its place. Both
        parts are copies, so evicting one frees its memory."""
        parent = node.parent
        upper = _Node(
            node.tokens[:size].clone(),
            [(k[:, :size].clone(), v[:, :size].clone()) for k, v in node.kv],
            parent,
        )
        upper.used = node.used
        parent.children[self._key(upper.tokens, 0)] = upper
        node.tokens = node.tokens[size:].clone()
        node.kv = [(k[:, size:].clone(), v[:, size:].clone()) for k, v in node.kv]
        node.parent = upper
        upper.children[self._key(node.tokens, 0)] = node
        self.stats.nodes += 1
        return upper

    def _touch(self, node: _Node) -> None:
        self._clock += 1
        node.used = self._clock

    def _leaves(self) -> list[_Node]:
        leaves, stack = [], list(self._root.children.values())
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            else:
                leaves.append(node)
        return leaves

    def _evict(self) -> None:
        while self.stats.bytes > self.budget_bytes:
            leaf = min(self._leaves(), key=lambda node: node.used)
            del leaf.parent.children[self._key(leaf.tokens, 0)]
            self.stats.bytes -= leaf.nbytes
            self.stats.tokens_evicted += leaf.tokens.numel()
            self.stats.nodes -= 1
