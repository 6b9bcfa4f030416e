"""Which inference replica answers a question: the one whose cluster cache best holds
the IVF clusters the question lands in, unless load is uneven.

The ingress embeds q_in once and ranks the centroids (`replicas.QuestionPlacer`); the request
carries its nearest clusters (`RouteHint`) to the router, and the replica reuses the embedding.
Replicas report their resident clusters through Ray Serve's `record_routing_stats`, every
`cluster.routing_stats_period_s`; between reports the router counts the clusters it has just
sent a replica as resident there (the replica's prefetch is copying them), as SGLang's router
inserts a prompt into its worker's tree when it routes it.

The rule (`choose`) is SGLang's `cache_aware` one, with IVF clusters in place of prompt
prefixes: when the load is uneven (the busiest replica has more than `balance_abs_threshold`
requests over the idlest and more than `balance_rel_threshold` times its count) the
least-loaded replica comes first; else a request that names a routing key goes to the key's
replica (rendezvous hashing: the same key, the same replica while the set of replicas is the
same); else to the replica holding most of the question's clusters, nearer clusters first; a
question none of them holds goes to the least-loaded replica with the fewest resident clusters.
`router.ClusterRouter` is the Ray Serve `RequestRouter` that applies it. Nothing here imports Ray.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

ROUTE_KWARG = "route"  # the keyword argument of a replica call that carries its RouteHint


@dataclass(frozen=True)
class RouteHint:
    """What the router knows of a request before it reaches a replica."""

    clusters: tuple[int, ...] = ()  # q_in's nearest clusters, nearest first
    key: str | None = None  # the client's routing key (header X-Routing-Key)


class Rule(StrEnum):
    """Why a replica was chosen: the `rule` label of `telerag_routing_decisions_total`."""

    CLUSTERS = "clusters"  # it held most of the question's clusters
    KEY = "key"  # the request's routing key maps to it
    LEAST_LOADED = "least_loaded"  # load was uneven, or no replica held any of the clusters
    DEFAULT = "default"  # Ray Serve's power of two choices (policy "default")


@dataclass(frozen=True)
class Balance:
    """SGLang's `cache_aware` test of uneven load."""

    abs_threshold: int
    rel_threshold: float

    def uneven(self, loads: Sequence[int]) -> bool:
        if not loads:
            return False
        busiest, idlest = max(loads), min(loads)
        return busiest - idlest > self.abs_threshold and busiest > self.rel_threshold * idlest


@dataclass(frozen=True)
class Candidate:
    """A replica as the rule sees it: its requests (running and queued) and resident clusters."""

    id: str
    load: int
    clusters: frozenset[int]


def choose(hint: RouteHint, candidates: Sequence[Candidate], balance: Balance) -> tuple[list[str], Rule]:
    """The candidates' ids, the preferred first, and the rule that ordered them."""
    by_load = [c.id for c in sorted(candidates, key=lambda c: (c.load, len(c.clusters), c.id))]
    if balance.uneven([c.load for c in candidates]):
        return by_load, Rule.LEAST_LOADED
    if hint.key is not None:
        return sorted((c.id for c in candidates), key=lambda id_: _weight(hint.key or "", id_), reverse=True), Rule.KEY
    scores = {c.id: _coverage(hint.clusters, c.clusters) for c in candidates}
    if not any(scores.values()):
        return by_load, Rule.LEAST_LOADED
    return sorted(by_load, key=lambda id_: scores[id_], reverse=True), Rule.CLUSTERS  # stable: ties by load


def _coverage(wanted: Sequence[int], resident: frozenset[int]) -> float:
    """How much of `wanted` (nearest first) is resident: each cluster weighs 1/(1 + its rank), so
    that holding the nearest counts most."""
    return sum(1.0 / (1 + rank) for rank, cluster in enumerate(wanted) if cluster in resident)


def _weight(key: str, replica: str) -> int:
    """Rendezvous hashing: the replica of largest weight for a key keeps it while it lives."""
    return int.from_bytes(hashlib.blake2b(f"{key}\0{replica}".encode(), digest_size=8).digest(), "big")


class RoutingDecisions:
    """How many requests each rule routed, in this process (the ingress's): its `/metrics` reads it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[Rule, int] = dict.fromkeys(Rule, 0)

    def count(self, rule: Rule) -> None:
        with self._lock:
            self._counts[rule] += 1

    def counts(self) -> dict[Rule, int]:
        with self._lock:
            return dict(self._counts)


DECISIONS = RoutingDecisions()


class ReplicaStats:
    """The latest `record_routing_stats` of each live replica of each deployment, as this
    process's routers last heard them: the ingress reads the replicas' metrics here, which come
    with their stats (a call to each replica would wait behind its requests for a slot)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stats: dict[str, dict[str, dict[str, Any]]] = {}  # deployment -> replica -> stats

    def update(self, deployment: str, stats: dict[str, dict[str, Any]]) -> None:
        """`stats`: each live replica's, by its id."""
        with self._lock:
            self._stats[deployment] = stats

    def of(self, deployment: str) -> dict[str, dict[str, Any]]:
        with self._lock:
            return dict(self._stats.get(deployment, {}))


REPLICA_STATS = ReplicaStats()
