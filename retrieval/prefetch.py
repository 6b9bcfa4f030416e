"""Prefetch planning (TeleRAG §4.2): rank q_in's nearest clusters and take them in rank order
until a byte budget is spent; for several queries, interleave their ranks."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from telerag.retrieval.cache import Lease


@dataclass
class PrefetchPlan:
    clusters: list[int]  # in the order they are copied
    per_query: list[frozenset[int]]  # C_in of each query: the planned clusters it ranked
    bytes: int


def plan_prefetch(ranked: np.ndarray, cluster_bytes: np.ndarray, budget_bytes: int) -> PrefetchPlan:
    """Take clusters rank by rank, query by query (rank 0 of every query, then rank 1, ...),
    skipping repeats and clusters that no longer fit, until `budget_bytes` is spent.

    `ranked` is (n_queries, depth): each query's clusters, nearest first.
    """
    chosen: dict[int, None] = {}
    per_query: list[set[int]] = [set() for _ in range(len(ranked))]
    spent = 0
    smallest = int(cluster_bytes[cluster_bytes > 0].min()) if np.any(cluster_bytes > 0) else 0
    for rank in range(ranked.shape[1] if ranked.ndim == 2 else 0):
        if budget_bytes - spent < smallest:
            break
        for query, cluster in enumerate(ranked[:, rank].tolist()):
            if cluster < 0:
                continue
            if cluster in chosen:
                per_query[query].add(cluster)
                continue
            size = int(cluster_bytes[cluster])
            if spent + size <= budget_bytes:
                chosen[cluster] = None
                per_query[query].add(cluster)
                spent += size
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
