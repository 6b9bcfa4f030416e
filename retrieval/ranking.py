"""How a search ranks a snapshot's passages: by meaning (the dense IVF search, as ever), by words
(BM25, `retrieval.keywords`), or both fused. One `Ranking` is chosen per request; a search calls
its `rank` with the dense search it would run anyway, so the dense path is unchanged by the others.

Hybrid fusion is exact given its two halves: each half's top `candidates` (the dense one exactly
IVF at the search's nprobe, the keyword one exactly BM25), fused by reciprocal rank (what OpenAI's
`hybrid_search` weights: a passage at rank r of a half earns weight / (60 + r)) or by a
weighted sum of each half's scores scaled to [0, 1] over its candidates (min to max). Either fused
score is divided by the most it can be, so it lies in [0, 1] (a `score_threshold`'s scale); ties
go to the smaller id.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Protocol

import numpy as np

from telerag.retrieval.errors import InvalidCall
from telerag.retrieval.keywords import keyword_search
from telerag.retrieval.shards import FAISS_PAD_SCORE

if TYPE_CHECKING:
    from telerag.retrieval.snapshot import Snapshot

RRF_K = 60  # reciprocal rank fusion's constant (Cormack et al. 2009; Elasticsearch's default too)
HYBRID_CANDIDATES = 20  # each half's depth in a hybrid search, at least the top_k

Ranked = tuple[np.ndarray, np.ndarray]  # (scores float32, ids int64), each (queries, k), padded as faiss pads
DenseSearch = Callable[[int, bool], Ranked]  # the dense search's top `depth`; `final`: its order is the answer's


@dataclass
class RankTrace:
    """What a ranking's steps took beside the dense search (a search step's stats show it)."""

    rerank_ms: float = 0.0


class SearchMode(StrEnum):
    DENSE = "dense"
    KEYWORD = "keyword"
    HYBRID = "hybrid"


class Fusion(StrEnum):
    RRF = "rrf"
    WEIGHTED = "weighted"


class Ranking(Protocol):
    @property
    def mode(self) -> SearchMode: ...

    @property
    def uses_vectors(self) -> bool:
        """Whether it reads the queries' embeddings (the keyword half alone does not)."""
        ...

    def rank(
        self, snapshot: Snapshot, texts: Sequence[str], k: int, dense: DenseSearch, trace: RankTrace | None = None
    ) -> Ranked:
        """Each query's top k of `snapshot` (`texts`: each query's words; `dense`: its dense search;
        `trace`: where its other steps' times go)."""
        ...


@dataclass(frozen=True)
class DenseRanking:
    mode: SearchMode = SearchMode.DENSE

    @property
    def uses_vectors(self) -> bool:
        return True

    def rank(
        self, snapshot: Snapshot, texts: Sequence[str], k: int, dense: DenseSearch, trace: RankTrace | None = None
    ) -> Ranked:
        return dense(k, True)


@dataclass(frozen=True)
class KeywordRanking:
    mode: SearchMode = SearchMode.KEYWORD

    @property
    def uses_vectors(self) -> bool:
        return False

    def rank(
        self, snapshot: Snapshot, texts: Sequence[str], k: int, dense: DenseSearch, trace: RankTrace | None = None
    ) -> Ranked:
        return keyword_search(snapshot, texts, k)


@dataclass(frozen=True)
class HybridRanking:
    embedding_weight: float = 1.0
    text_weight: float = 1.0
    fusion: Fusion = Fusion.RRF
    candidates: int = HYBRID_CANDIDATES
    mode: SearchMode = SearchMode.HYBRID

    def __post_init__(self) -> None:
        weights = (self.embedding_weight, self.text_weight)
        if not all(math.isfinite(w) and w >= 0 for w in weights) or max(weights) <= 0:
            raise InvalidCall(f"hybrid weights must be at least 0, one above: {self.embedding_weight}, {self.text_weight}")
        if self.candidates < 1:
            raise InvalidCall(f"hybrid candidates must be at least 1, not {self.candidates}")

    @property
    def uses_vectors(self) -> bool:
        return True

    def rank(
        self, snapshot: Snapshot, texts: Sequence[str], k: int, dense: DenseSearch, trace: RankTrace | None = None
    ) -> Ranked:
        depth = max(k, self.candidates)
        halves = (dense(depth, False), keyword_search(snapshot, texts, depth))
        largest = max(self.embedding_weight, self.text_weight)  # scaled to at most 1: the fused order and score are the same
        weights = (self.embedding_weight / largest, self.text_weight / largest)
        fuse = reciprocal_rank_fusion if self.fusion is Fusion.RRF else weighted_fusion
        return fuse(halves, weights, k)


DENSE = DenseRanking()


def ranking_of(mode: SearchMode | str, *, fusion: Fusion | str = Fusion.RRF, candidates: int = HYBRID_CANDIDATES) -> Ranking:
    """The ranking a mode names (a hybrid one with equal weights)."""
    mode = SearchMode(mode)
    if mode is SearchMode.KEYWORD:
        return KeywordRanking()
    if mode is SearchMode.HYBRID:
        return HybridRanking(fusion=Fusion(fusion), candidates=candidates)
    return DENSE


def reciprocal_rank_fusion(halves: Sequence[Ranked], weights: Sequence[float], k: int) -> Ranked:
    """Each row's top k by the weighted sum of 1 / (RRF_K + rank) over the halves that hold it
    (rank from 1), over the most a passage can earn (first in every half)."""
    best = sum(weights) / (RRF_K + 1)
    return _fused(halves, [w / (RRF_K + 1 + np.arange(h[1].shape[1])) / best for h, w in zip(halves, weights, strict=True)], k)


def weighted_fusion(halves: Sequence[Ranked], weights: Sequence[float], k: int) -> Ranked:
    """Each row's top k by the weighted sum of each half's scores scaled to [0, 1] over the row's
    candidates (all equal: 1), over the weights' sum."""
    total = sum(weights)
    earned = []
    for (scores, ids), weight in zip(halves, weights, strict=True):
        valid = ids >= 0
        low = np.where(valid, scores, np.inf).min(axis=1, keepdims=True)
        high = np.where(valid, scores, -np.inf).max(axis=1, keepdims=True)
        span = np.where(high > low, high - low, 1.0)
        scaled = np.where(high > low, (scores.astype(np.float64) - low) / span, 1.0)
        earned.append(weight * scaled / total)
    return _fused(halves, earned, k)


def _fused(halves: Sequence[Ranked], earned: Sequence[np.ndarray], k: int) -> Ranked:
    """Each row's top k passages by what they earned (`earned[h]`: per row and rank of half h, or
    one row for every row), summed over the halves that hold them, then by id."""
    n = halves[0][1].shape[0]
    out_scores = np.full((n, k), FAISS_PAD_SCORE, dtype=np.float32)
    out_ids = np.full((n, k), -1, dtype=np.int64)
    for row in range(n):
        ids = np.concatenate([h[1][row] for h in halves])
        points = np.concatenate([np.broadcast_to(e, h[1].shape)[row] for h, e in zip(halves, earned, strict=True)])
        valid = ids >= 0
        unique, at = np.unique(ids[valid], return_inverse=True)
        totals = np.bincount(at, weights=points[valid], minlength=len(unique))
        top = np.lexsort((unique, -totals))[:k]
        out_scores[row, : len(top)] = totals[top]
        out_ids[row, : len(top)] = unique[top]
    return out_scores, out_ids
