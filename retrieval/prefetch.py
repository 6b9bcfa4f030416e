"""Prefetch planning (TeleRAG §4.2): rank q_in's nearest clusters and take them in rank order
until a byte budget is spent; for several queries, interleave their ranks, a cluster that
several of them rank near the top first."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

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
) -> PrefetchPlan:
    """Take each query's clusters rank by rank, query by query (rank 0 of every query, then
    rank 1, ...), skipping repeats and clusters that no longer fit, until `budget_bytes` is spent.

    A cluster that k queries rank within `depth` (their likely C_out; default: every rank) moves
    up to its best rank divided by k, so under batch load the clusters several queries want come
    first. Clusters `resident` already (a mask over cluster ids) cost nothing: they are pinned,
    not copied. `ranked` is (n_queries, width): each query's clusters, nearest first.
    """
    n_queries, width = ranked.shape if ranked.ndim == 2 else (0, 0)
    depth = width if depth is None else min(depth, width)
    costs = np.where(resident, 0, cluster_bytes) if resident is not None else np.asarray(cluster_bytes)
    positive = costs[costs > 0]
    smallest = int(positive.min()) if len(positive) else 0
    chosen: dict[int, None] = {}
    per_query: list[set[int]] = [set() for _ in range(n_queries)]
    queries, ranks = np.nonzero(ranked >= 0) if n_queries and width else (np.zeros(0, np.int64),) * 2
    clusters = ranked[queries, ranks]
    best = np.full(len(costs), np.inf)
    np.minimum.at(best, clusters, ranks)
    wanted_by = np.bincount(clusters[ranks < depth], minlength=len(costs))
    key = best[clusters] / np.maximum(wanted_by[clusters], 1)
    order = np.lexsort((queries, ranks, key))
    spent = 0
    for query, cluster in zip(queries[order].tolist(), clusters[order].tolist(), strict=True):
        if not smallest or budget_bytes - spent < smallest:
            break  # nothing more can be copied
        size = int(costs[cluster])
        if not size or cluster in chosen:
            continue  # resident ones are taken within depth, below
        if spent + size <= budget_bytes:
            chosen[cluster] = None
            per_query[query].add(cluster)
            spent += size
    # Each query's C_in is every planned cluster it ranks within depth; resident ones there are
    # planned too (pinned for free), whatever the budget reached.
    near = ranks < depth
    for query, cluster in zip(queries[near].tolist(), clusters[near].tolist(), strict=True):
        if cluster in chosen or (resident is not None and costs[cluster] == 0):
            chosen.setdefault(cluster, None)
            per_query[query].add(cluster)
    return PrefetchPlan(clusters=list(chosen), per_query=[frozenset(q) for q in per_query], bytes=spent)


@dataclass
class PrefetchHandle:
    """A started prefetch: its plan, the lease pinning its clusters, and its stats."""

    plan: PrefetchPlan
    lease: Lease | None
    stats: dict[str, Any] = field(default_factory=dict)

    def release(self) -> None:
        if self.lease is not None:
            self.lease.release()
