"""Prefetch planning (TeleRAG §4.2): rank q_in's nearest clusters and take them in rank order
until a byte budget is spent, never past a reach down the ranking; for several queries, interleave
their ranks, a cluster that several of them rank near the top first."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from telerag.retrieval.stats import PrefetchStats

if TYPE_CHECKING:
    from telerag.retrieval.cache import Lease


@dataclass
class PrefetchPlan:
    clusters: list[int]  # in the order they are taken
    per_query: list[frozenset[int]]  # C_in of each query: the planned clusters it ranked
    bytes: int  # what the plan copies: clusters already resident cost nothing


def plan_prefetch(
    ranked: np.ndarray,
    cluster_bytes: np.ndarray,
    budget_bytes: int,
    *,
    resident: np.ndarray | None = None,
    depth: int | None = None,
    reach: float = math.inf,
) -> PrefetchPlan:
    """Take each query's clusters rank by rank, query by query (rank 0 of every query, then
    rank 1, ...), skipping repeats and clusters that no longer fit, until `budget_bytes` is spent
    or no query ranks the next cluster within `reach` (ranks 0 to reach - 1: beyond it a search
    is unlikely to probe what is read, which the reads' bytes would pay for regardless).

    A cluster that k queries rank within `depth` (their likely C_out; default: every rank) moves
    up to its best rank divided by k, so under batch load the clusters several queries want come
    first. Clusters `resident` already (a mask over cluster ids) cost nothing: they are pinned,
    not copied. `ranked` is (n_queries, width): each query's clusters, nearest first.
    """
    n_queries, width = ranked.shape if ranked.ndim == 2 else (0, 0)
    nclusters = len(cluster_bytes)
    depth = width if depth is None else min(depth, width)
    costs = np.where(resident, 0, cluster_bytes) if resident is not None else np.asarray(cluster_bytes)
    rank = np.full((n_queries, nclusters), np.iinfo(np.int64).max, dtype=np.int64)  # rank[q, c]
    rows, cols = np.nonzero(ranked >= 0)
    rank[rows, ranked[rows, cols]] = cols
    best = rank.min(axis=0, initial=np.iinfo(np.int64).max)
    near = rank < depth
    key = best / np.maximum(near.sum(axis=0), 1)
    candidates = np.flatnonzero((best < min(width, reach)) & (costs > 0))
    order = candidates[np.lexsort((candidates, best[candidates], key[candidates]))]
    positive = costs[costs > 0]
    smallest = int(positive.min()) if len(positive) else 0
    chosen: dict[int, None] = {}
    spent = 0
    for cluster, size in zip(order.tolist(), costs[order].tolist(), strict=True):
        if budget_bytes - spent < smallest:
            break  # nothing more can be copied
        if spent + size <= budget_bytes:
            chosen[cluster] = None
            spent += size
    # Each query's C_in: the planned clusters it ranks within depth, and those it ranks best.
    # Clusters already resident within depth are planned too (pinned for free).
    taken = np.zeros(nclusters, dtype=bool)
    taken[list(chosen)] = True
    owner = rank.argmin(axis=0) if n_queries else np.zeros(nclusters, dtype=np.int64)
    if resident is not None:
        for cluster in np.flatnonzero(near.any(axis=0) & (costs == 0)).tolist():
            chosen.setdefault(cluster, None)
        taken[list(chosen)] = True
    per_query = [set(np.flatnonzero(taken & (near[q] | (owner == q))).tolist()) for q in range(n_queries)]
    return PrefetchPlan(clusters=list(chosen), per_query=[frozenset(q) for q in per_query], bytes=spent)


@dataclass
class PrefetchHandle:
    """A started prefetch: its plan, the lease pinning its clusters, and its stats."""

    plan: PrefetchPlan
    lease: Lease | None
    stats: PrefetchStats = field(default_factory=PrefetchStats)

    def release(self) -> None:
        if self.lease is not None:
            self.lease.release()
