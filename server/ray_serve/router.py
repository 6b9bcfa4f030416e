"""The inference replicas' Ray Serve `RequestRouter` (`routing` says what it does and why). Ray
copies this module by value into every process that routes (Serve pickles a request router's
module), so it keeps no state of its own: what a process shares (the decisions' counts, the
replicas' reports) lives in `routing`, reached through the module."""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass
from typing import Any

from ray.serve.request_router import FIFOMixin, LocalityMixin, PendingRequest, ReplicaID, RequestRouter, RunningReplica

from telerag.server.ray_serve import routing


@dataclass(frozen=True)
class RouterOptions:
    deployment: str = "inference"  # the deployment it routes to, whose replicas' reports it shares (`routing.REPLICA_STATS`)
    policy: str = "cluster"  # or "default": the power of two choices, as Ray Serve's own router
    balance_abs_threshold: int = 4
    balance_rel_threshold: float = 1.5
    recent_s: float = 1.0  # how long clusters just sent to a replica count as resident there before it reports


class ClusterRouter(FIFOMixin, LocalityMixin, RequestRouter):
    """The Ray Serve request router of the inference replicas (`cluster.inference_application`),
    on Serve's public request-router classes only: requests in arrival order (`FIFOMixin`), the
    default policy's candidates on this node first (`LocalityMixin`), as Serve's own router does."""

    def initialize_state(self, **kwargs: Any) -> None:
        """`kwargs`: a `RouterOptions`'s fields (the deployment's `request_router_kwargs`)."""
        self.options = RouterOptions(**kwargs)
        self.balance = routing.Balance(self.options.balance_abs_threshold, self.options.balance_rel_threshold)
        self._sent: dict[ReplicaID, dict[int, float]] = {}  # replica -> cluster -> when sent

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        hint = _hint(pending_request)
        if self.options.policy != "cluster" or hint is None or not candidate_replicas:
            routing.DECISIONS.count(routing.Rule.DEFAULT)
            return self._two_choices(pending_request)
        loads = await self._loads(candidate_replicas)
        now = time.monotonic()
        candidates = [
            routing.Candidate(r.replica_id.unique_id, loads.get(r.replica_id, 0), self._resident(r, now))
            for r in candidate_replicas
        ]
        order, rule = routing.choose(hint, candidates, self.balance)
        routing.DECISIONS.count(rule)
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True  # every rank tried: wait before trying again
        return [[by_id[id_]] for id_ in order]

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        """The live replicas, as Serve tells every handle's router when they or their stats change."""
        super().update_replicas(replicas)
        routing.REPLICA_STATS.update(
            self.options.deployment, {r.replica_id.unique_id: dict(r.routing_stats or {}) for r in replicas}
        )

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        hint = _hint(pending_request)
        if hint is not None and hint.clusters:
            now = time.monotonic()
            self._sent.setdefault(replica_id, {}).update(dict.fromkeys(hint.clusters, now))

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._sent.pop(replica_id, None)

    def _two_choices(self, pending_request: PendingRequest | None) -> list[list[RunningReplica]]:
        """Two replicas at random (this node's first, where Serve prefers them): Serve sends the
        request to the one of them with fewer requests, as with its own default router."""
        ids = list(self.apply_locality_routing(pending_request))
        replicas = self.curr_replicas
        return [[replicas[id_] for id_ in random.sample(ids, min(2, len(ids))) if id_ in replicas]] if ids else []

    def _resident(self, replica: RunningReplica, now: float) -> frozenset[int]:
        """What the replica last reported, and what was sent to it since (recently)."""
        reported = (replica.routing_stats or {}).get("clusters", ())
        sent = self._sent.get(replica.replica_id, {})
        for cluster in [c for c, when in sent.items() if now - when > self.options.recent_s]:
            del sent[cluster]
        return frozenset(reported) | frozenset(sent)

    async def _loads(self, replicas: list[RunningReplica]) -> dict[ReplicaID, int]:
        """Each replica's requests, from the queue-length cache, or asked now where it has none
        (within Serve's deadline for the answer; a replica that does not answer counts as idle
        here, and Serve asks it again before it sends anything)."""
        cache = self.replica_queue_len_cache
        loads: dict[ReplicaID, int] = {}
        unknown = []
        for replica in replicas:
            cached = cache.get(replica.replica_id)
            if cached is None:
                unknown.append(replica)
            else:
                loads[replica.replica_id] = cached
        if unknown:
            deadline = self.queue_len_response_deadline_s
            asked = [asyncio.ensure_future(r.get_queue_len(deadline_s=deadline)) for r in unknown]
            await asyncio.wait(asked, timeout=deadline)
            for replica, answer in zip(unknown, asked, strict=True):
                if answer.done() and not answer.cancelled() and answer.exception() is None:
                    loads[replica.replica_id] = answer.result()
                    cache.update(replica.replica_id, answer.result())
                else:
                    answer.cancel()
        return loads


def _hint(pending_request: PendingRequest | None) -> routing.RouteHint | None:
    hint = None if pending_request is None else pending_request.kwargs.get(routing.ROUTE_KWARG)
    return hint if isinstance(hint, routing.RouteHint) else None
