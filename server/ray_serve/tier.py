"""The retrieval tier on Ray Serve (Chameleon's disaggregated memory nodes): a datastore's shards
(`retrieval.shards`), each a Serve deployment of R replicas in one application, and the caller's side, which
searches given lists as `CPUIndex.search_lists` does, by asking one replica of every shard and
merging their top-k exactly.

A live datastore's writes reach the tier without the shards reading its log: a shard holds a
generation's files, which never change, and the writes since (the delta rows, the deletions) are
applied by the caller, whose snapshot holds them (`retrieval.snapshot.search_snapshot`: deleted
rows over-fetched and dropped, delta rows scanned beside). What a shard follows is the writer's
switch to a new generation (a compaction, a retrain): each call names the generation its
request's snapshot reads, and a replica that does not hold it yet loads it (its part of it)
before it searches; it keeps the one before for the requests that began before the switch.

A shard whose call fails (its replica died or was restarting) is asked again, and Serve routes
the retry to a live replica of the same shard; if every attempt fails the whole search fails
with `TierUnavailable`: a partial top-k is never returned as whole. A shard whose replicas'
queues are full answers `TierBusy`. Ray is an optional dependency (the `ray` extra): this module
imports it only when a tier is deployed or reached.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from telerag.retrieval.datastore import Datastore
from telerag.retrieval.early_stop import EarlyStopSearch, ListBounds
from telerag.retrieval.errors import GenerationGone, TierBusy, TierUnavailable
from telerag.retrieval.ivf import CPUIndex, ListSearch, faiss
from telerag.retrieval.shards import ShardRows, merge_shard_results

log = logging.getLogger(__name__)

APP = "telerag-retrieval"  # the Serve application: the tier's directory and its shards' deployments


def shard_deployment(shard: int) -> str:
    return f"shard-{shard}"


class ShardReplica:
    """One replica of one shard: its part of every list, searched for given lists. Loads only
    its rows of the datastore's vectors (a memory node holds its partition, not the whole), of
    the generations the callers name: the current one when it starts, then each the writer
    switches to, with the one before it kept."""

    def __init__(
        self,
        datastore: str,
        shard: int,
        shards: int,
        *,
        threads: int = 1,
        verify_checksums: bool = True,
        early_stop: bool = False,
    ) -> None:
        """`early_stop`: scan this shard's part of the lists with exact early stop, bounded by
        each whole list's statistics (they bound any part of it too)."""
        self.threads = threads  # its share of the node's cores, not all of them
        self.path, self.shard, self.shards, self.early_stop = Path(datastore), shard, shards, early_stop
        self.generations: dict[int, ListSearch] = {}
        self._loading = asyncio.Lock()
        self._load(verify_checksums)

    def _load(self, verify_checksums: bool) -> int:
        """The datastore's current generation, this shard's part of it; the generations before the
        one before it let go of."""
        store = Datastore.load(self.path, verify_checksums=verify_checksums)
        rows = ShardRows.of(store.offsets, self.shard, self.shards)
        index = CPUIndex(store, shard=rows)
        number = store.generation.number
        self.generations[number] = EarlyStopSearch(index, ListBounds.of(store)) if self.early_stop else index
        for older in [n for n in self.generations if n < number - 1]:
            del self.generations[older]
        log.info(
            "shard %d of %d: %d of %d rows of %s, generation %d",
            self.shard,
            self.shards,
            len(rows.ids),
            store.n_vectors,
            self.path,
            number,
        )
        return number

    async def search_lists(
        self, queries: np.ndarray, k: int, lists: np.ndarray, list_scores: np.ndarray, generation: int | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Searched on Serve's event loop for user code, not handed to its thread pool as a sync
        method would be (with the gRPC transport, `RetrievalTier.connect`, 2.6-5 ms less a
        search on two cores); the replica searches one request at a time, as its CPUs would
        anyway. OpenMP's thread count belongs to the calling thread, so it is set here, in the
        thread that searches, not in `__init__`'s. A generation this replica does not hold is
        loaded first (the writer's files are whole once it switched; checked when written)."""
        if generation is None:  # a caller of no particular generation (a benchmark): the newest held
            generation = max(self.generations)
        searched = self.generations.get(generation)
        if searched is None:
            async with self._loading:
                if generation not in self.generations and generation > max(self.generations):
                    await asyncio.to_thread(self._load, False)
            searched = self.generations.get(generation)
            if searched is None:
                raise GenerationGone(
                    f"retrieval shard {self.shard}: generation {generation} of {self.path} is not held here "
                    f"(it holds {sorted(self.generations)})"
                )
        faiss.omp_set_num_threads(self.threads)
        return searched.search_lists(queries, k, lists, list_scores)


@dataclass(frozen=True)
class TierShape:
    """How many shards, and the replicas and CPUs each of their replicas gets."""

    shards: int
    replicas: int = 1
    cpus_per_replica: float = 1.0
    max_replicas: int = 0  # autoscaling: between `replicas` and this many per shard; 0: `replicas` always
    max_ongoing_requests: int = 8  # per replica; past it requests queue in the caller's router
    max_queued_requests: int = 64  # per caller; past it a call is refused at once (TierBusy)
    early_stop: bool = False  # each shard scans with exact early stop (`experiments.early_stop`)
    # what the autoscaler keeps each replica at: a replica searches one request at a time, so
    # more than one in flight is a queue
    target_ongoing_requests: float = 1.0


def replica_scaling(replicas: int, max_replicas: int, target_ongoing_requests: float) -> dict[str, Any]:
    """Serve's deployment options for `replicas` always (`max_replicas` 0) or for autoscaling
    between the two, keeping each replica at `target_ongoing_requests` (both tiers' deployments)."""
    if not max_replicas:
        return {"num_replicas": replicas}
    bounds = {"min_replicas": replicas, "max_replicas": max_replicas, "target_ongoing_requests": target_ongoing_requests}
    return {"autoscaling_config": bounds}


class TierDirectory:
    """The tier application's ingress: what the tier is, so that a caller (another process, an
    inference replica) reaches it by the application's name alone. Deployed with the shards, as
    one application, so that Serve starts every shard's replicas at once."""

    def __init__(self, datastore: str, *shards: Any) -> None:
        """`shards`: the shard deployments' handles (Serve passes them in shard order)."""
        self.datastore, self.count = datastore, len(shards)

    def describe(self) -> dict[str, Any]:
        return {"datastore": self.datastore, "shards": self.count}


def tier_application(datastore: Path | str, shape: TierShape, *, verify_checksums: bool = True) -> Any:
    """The tier as one Serve application (a Ray `Application`): the directory and a deployment
    per shard. `deploy_tier` runs it; `serve run`'s config file builds it the same way
    (`server.ray_serve.serve_config`)."""
    path = str(Path(datastore).expanduser().resolve())  # every node of the cluster reads it at this path
    threads = max(1, math.floor(shape.cpus_per_replica))
    *shards, directory = tier_deployments(shape)
    bound = [
        shard.bind(path, number, shape.shards, threads=threads, verify_checksums=verify_checksums, early_stop=shape.early_stop)
        for number, shard in enumerate(shards)
    ]
    return directory.bind(path, *bound)


def tier_deployments(shape: TierShape) -> list[Any]:
    """The tier's Serve deployments, one per shard and then the directory that calls them (as
    Serve lists an application's), sized by `shape`; unbound: what the Serve config file describes."""
    from ray import serve

    scaling = replica_scaling(shape.replicas, shape.max_replicas, shape.target_ongoing_requests)
    shards = [
        serve.deployment(
            name=shard_deployment(number),
            ray_actor_options={"num_cpus": shape.cpus_per_replica},
            max_ongoing_requests=shape.max_ongoing_requests,
            max_queued_requests=shape.max_queued_requests,
            **scaling,
        )(ShardReplica)
        for number in range(shape.shards)
    ]
    return [*shards, serve.deployment(name="directory", ray_actor_options={"num_cpus": 0})(TierDirectory)]


def deploy_tier(datastore: Path | str, shape: TierShape, *, verify_checksums: bool = True) -> RetrievalTier:
    """Deploy the tier (every shard's replicas ready before this returns) on the Ray cluster
    this process is connected to, with Serve started, and return the caller's side."""
    from ray import serve

    serve.run(tier_application(datastore, shape, verify_checksums=verify_checksums), name=APP, route_prefix=None)
    return RetrievalTier.connect()


class RetrievalTier:
    """The caller's side of the tier: `search_lists` as `CPUIndex`'s, over every shard, of one
    generation of the datastore (`at`)."""

    def __init__(
        self,
        handles: Sequence[Any],
        *,
        generation: int | None = None,
        timeout_s: float = 60.0,
        attempts: int = 3,
        retry_wait_s: float = 0.5,
    ) -> None:
        """`handles`: one Serve `DeploymentHandle` per shard, in shard order; `generation`: the one
        every search names (None: each shard's newest, for a caller of a datastore no writer changes)."""
        self.handles = list(handles)
        self.generation = generation
        self.timeout_s, self.attempts, self.retry_wait_s = timeout_s, attempts, retry_wait_s
        self.retries = 0  # calls asked again after a failure, over the tier's life

    def at(self, datastore: Datastore) -> RetrievalTier:
        """The tier searching `datastore`'s generation (the same shards and handles)."""
        return RetrievalTier(
            self.handles,
            generation=datastore.generation.number,
            timeout_s=self.timeout_s,
            attempts=self.attempts,
            retry_wait_s=self.retry_wait_s,
        )

    @classmethod
    def connect(cls, *, wait_s: float = 300.0, **kwargs: Any) -> RetrievalTier:
        """The tier as deployed (by this process or another) on the connected Ray cluster,
        waited for up to `wait_s` (`serve run` of a config file deploys every application at
        once: an inference replica may start before the tier exists)."""
        from ray import serve
        from ray.serve.exceptions import RayServeException

        deadline = time.monotonic() + wait_s
        while True:
            try:
                directory = serve.get_app_handle(APP)
                break
            except RayServeException:
                if time.monotonic() > deadline:
                    raise TierUnavailable(f"no retrieval tier ({APP}) on this Ray cluster after {wait_s:.0f} s") from None
                time.sleep(1.0)
        shards = directory.describe.remote().result(timeout_s=wait_s)["shards"]
        # Serve's gRPC transport from the handle to the replica: one unary call carrying the
        # replica's acceptance and the answer, where the default (an actor call) streams them
        # back as two objects; with the shards' async method, 2.6-5 ms less a search on two
        # cores (docs/benchmarks.md)
        handles = [
            serve.get_deployment_handle(shard_deployment(number), app_name=APP).options(_by_reference=False)
            for number in range(shards)
        ]
        return cls(handles, **kwargs)

    def search_lists(
        self, queries: np.ndarray, k: int, lists: np.ndarray, list_scores: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        args = (np.ascontiguousarray(queries, dtype=np.float32), k, lists, list_scores, self.generation)
        calls = [handle.search_lists.remote(*args) for handle in self.handles]
        parts = [self._result(shard, call, args) for shard, call in enumerate(calls)]
        return merge_shard_results(parts, k)

    def _result(self, shard: int, call: Any, args: tuple) -> tuple[np.ndarray, np.ndarray]:
        """Shard `shard`'s answer; a failed call is sent again (to a live replica) until the
        attempts run out."""
        from ray.exceptions import GetTimeoutError, RayActorError
        from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError, ReplicaUnavailableError

        # a replica started after the switch away from a request's generation: another may hold it
        retried = (RayActorError, ReplicaUnavailableError, DeploymentUnavailableError, GetTimeoutError, GenerationGone)
        attempt = 1
        while True:
            try:
                result: tuple[np.ndarray, np.ndarray] = call.result(timeout_s=self.timeout_s)
                return result
            except BackPressureError as exc:
                raise TierBusy(f"retrieval shard {shard}: every replica's queue is full") from exc
            except retried as exc:
                if attempt == self.attempts:
                    raise TierUnavailable(f"retrieval shard {shard} did not answer in {attempt} attempts: {exc}") from exc
                log.warning("retrieval shard %d: %s; asking again (attempt %d)", shard, type(exc).__name__, attempt + 1)
                self.retries += 1
                time.sleep(self.retry_wait_s * attempt)
                attempt += 1
                call = self.handles[shard].search_lists.remote(*args)
