"""The transformers engine's prefix cache: the KV of prompts' token-id prefixes in a radix tree
(SGLang's RadixAttention), so that a prompt beginning as an earlier one did is prefilled only from
where the two part. RAG prompts repeat long beginnings: a pipeline's fixed instruction, the same
documents for the same question, the growing prompts of the iterative pipelines.

Each edge holds its tokens' keys and values for every layer (a copy, so that evicting it frees
them). Leaves are evicted least recently used once the tree's bytes pass the budget. Only the
engine's worker thread reads or changes the tree; other threads read its counters.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

LayerKV = tuple[torch.Tensor, torch.Tensor]  # one layer's (keys, values): (1, kv heads, tokens, head dim)


@dataclass(eq=False)
class _Node:
    tokens: tuple[int, ...]  # the edge into this node
    kv: list[LayerKV]  # those tokens' keys and values, per layer
    parent: _Node | None
    children: dict[int, _Node] = field(default_factory=dict)  # by their edges' first token
    used: int = 0  # when last matched or inserted, by the tree's clock

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.kv)


@dataclass(frozen=True)
class PrefixHit:
    """The longest cached prefix of a prompt: its length and its KV per layer (empty when 0)."""

    tokens: int
    kv: list[LayerKV]


class PrefixCache:
    """Token-id prefixes and their KV, within `budget_bytes`."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self.bytes = 0
        self.evicted_bytes = 0
        self._root = _Node(tokens=(), kv=[], parent=None)
        self._clock = itertools.count(1)

    def match(self, ids: Sequence[int]) -> PrefixHit:
        """The longest prefix of `ids` in the tree, its nodes marked as just used."""
        node, matched, path = self._root, 0, []
        while matched < len(ids) and (child := node.children.get(ids[matched])) is not None:
            common = _common_length(child.tokens, ids[matched:])
            path.append((child, common))
            matched += common
            if common < len(child.tokens):
                break
            node = child
        if not matched:
            return PrefixHit(0, [])
        now = next(self._clock)
        for child, _ in path:
            child.used = now
        layers = len(path[0][0].kv)
        kv = [
            (
                torch.cat([child.kv[layer][0][:, :, :common] for child, common in path], dim=2),
                torch.cat([child.kv[layer][1][:, :, :common] for child, common in path], dim=2),
            )
            for layer in range(layers)
        ]
        return PrefixHit(matched, kv)

    def insert(self, ids: Sequence[int], kv: Sequence[LayerKV], start: int = 0) -> None:
        """Remember `ids` whose tokens from `start` on have the KV `kv` (those before `start` must
        be in the tree already, as `match` found them; if they were evicted since, nothing is
        added). Then evict down to the budget."""
        node, at = self._root, 0
        now = next(self._clock)
        while at < len(ids):
            child = node.children.get(ids[at])
            if child is None:
                break
            common = _common_length(child.tokens, ids[at:])
            if common < len(child.tokens):
                child = self._split(child, common)
            child.used = now
            node, at = child, at + common
        if at < start or at >= len(ids):
            return
        offset = at - start  # of the new tokens' KV already in the tree
        leaf = _Node(
            tokens=tuple(ids[at:]),
            kv=[(k[:, :, offset:].clone(), v[:, :, offset:].clone()) for k, v in kv],
            parent=node,
            used=now,
        )
        node.children[leaf.tokens[0]] = leaf
        self.bytes += leaf.nbytes
        self._evict()

    def _split(self, node: _Node, at: int) -> _Node:
        """Cut `node`'s edge after `at` tokens; returns the new upper half (the parent of `node`)."""
        assert node.parent is not None
        upper = _Node(
            tokens=node.tokens[:at],
            kv=[(k[:, :, :at].clone(), v[:, :, :at].clone()) for k, v in node.kv],
            parent=node.parent,
            used=node.used,
        )
        node.parent.children[upper.tokens[0]] = upper
        node.tokens = node.tokens[at:]
        node.kv = [(k[:, :, at:].clone(), v[:, :, at:].clone()) for k, v in node.kv]
        node.parent = upper
        upper.children[node.tokens[0]] = node
        return upper

    def _evict(self) -> None:
        """Drop least recently used leaves (a parent becomes a leaf in turn) down to the budget."""
        if self.bytes <= self.budget_bytes:
            return
        leaves = sorted(self._leaves(), key=lambda n: n.used)
        while self.bytes > self.budget_bytes and leaves:
            leaf = leaves.pop(0)
            parent = leaf.parent
            assert parent is not None
            del parent.children[leaf.tokens[0]]
            freed = leaf.nbytes
            self.bytes -= freed
            self.evicted_bytes += freed
            if parent is not self._root and not parent.children:
                leaves.insert(_position(leaves, parent.used), parent)

    def _leaves(self) -> list[_Node]:
        found, stack = [], list(self._root.children.values())
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            else:
                found.append(node)
        return found


def _common_length(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def _position(leaves: list[_Node], used: int) -> int:
    """Where a leaf last used at `used` goes in `leaves` (ordered by use)."""
    return next((i for i, leaf in enumerate(leaves) if leaf.used > used), len(leaves))
