"""The server's runtime as inference replicas on Ray Serve (Chameleon's inference nodes), and the ingress's side of them.

Each `InferenceReplica` is what `telerag serve` runs in one process (the engine, the pipelines over the batching
retriever, the cluster cache, lookahead), loaded by `runtime.load_runtime`; with a retrieval tier (`cluster.shards` >
0) the CPU half of its cooperative searches goes to the tier's shards, and lookahead's clusters still come from the
replica's memory map of the vectors, the only copy the cache is filled from. The ingress (the same FastAPI app,
`server.ray_serve.applications`) runs its service over a `ReplicaRuntime`: admission, the requests' metrics and the
HTTP API are the ingress's, each pipeline run is a streamed call to one replica (`ReplicaPipeline`), routed by
`routing.ClusterRouter` on q_in's nearest clusters, computed once by the ingress (`QuestionPlacer`), reused (`KnownVectors`).

A replica that fails before its run sent anything (it died, or was restarting) is asked again, and Serve routes the
retry to a live replica; one that fails after is a 503 (`ReplicasUnavailable`) in the one error body, or the stream's
error event: an accepted request is never lost silently. Ray is imported only here and in
`server.ray_serve.applications` and `server.ray_serve.routing`. The module is long because both ends of the
ingress's call to a replica live in it (what one ships, the other receives), so that call's contract reads in one file.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading
import time
import zlib
from collections.abc import AsyncGenerator, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from telerag.config.settings import Settings
from telerag.file_search.errors import VectorStoresUnavailable
from telerag.pipelines.text_encoder import embedded
from telerag.pipelines.types import (
    DatastoreInfo,
    EventSink,
    Pipeline,
    RagResult,
    ResultEvent,
    Retriever,
    RunEvent,
    RunOptions,
    Stage,
    TextEmbeddings,
    event_stream,
)
from telerag.retrieval.stats import CacheStats
from telerag.server.errors import ReplicasUnavailable
from telerag.server.observability.metrics import Metrics
from telerag.server.ray_serve.routing import REPLICA_STATS, ROUTE_KWARG, RouteHint
from telerag.server.service import Service

if TYPE_CHECKING:
    from telerag.documents.rebuilds import Rebuilds
    from telerag.documents.writer import DocumentWriter
    from telerag.server.ray_serve.writes import IngressWrites

log = logging.getLogger(__name__)

REPLICAS = "inference"  # the deployment of the inference replicas


# -- the replica --------------------------------------------------------------------------------


class KnownVectors:
    """The embedder (a `TextEncoder`), except for texts whose vectors the ingress computed before
    routing (q_in): those are not embedded again."""

    def __init__(self, embedder: Any) -> None:
        self.embedder, self.name, self.dim = embedder, embedder.name, embedder.dim
        self._lock = threading.Lock()
        self._known: dict[str, tuple[np.ndarray, int]] = {}  # text -> (vector, runs that gave it)

    @contextlib.contextmanager
    def given(self, text: str, vector: np.ndarray | None) -> Iterator[None]:
        """`text`'s vector is `vector` while the block runs (nothing with None)."""
        if vector is None:
            yield
            return
        with self._lock:
            _, runs = self._known.get(text, (vector, 0))
            self._known[text] = (vector, runs + 1)
        try:
            yield
        finally:
            with self._lock:
                _, runs = self._known[text]
                if runs == 1:
                    del self._known[text]
                else:
                    self._known[text] = (vector, runs - 1)

    def encode(self, texts: Sequence[str], *, pause: Callable[[], None] | None = None) -> np.ndarray:
        with self._lock:
            known = {i: self._known[t][0] for i, t in enumerate(texts) if t in self._known}
        if len(known) == len(texts):
            return np.stack([known[i] for i in range(len(texts))]).astype(np.float32, copy=False)
        rest = [i for i in range(len(texts)) if i not in known]
        encoded = embedded(self.embedder, [texts[i] for i in rest], pause=pause)
        out = np.empty((len(texts), encoded.shape[1]), dtype=np.float32)
        out[rest] = encoded
        for i, vector in known.items():
            out[i] = vector
        return out

    def count_tokens(self, texts: Sequence[str]) -> int:
        return int(self.embedder.count_tokens(texts))


@dataclass(frozen=True)
class PipelineShape:
    """A pipeline as the ingress describes it (`/v1/pipelines`, admission's cost) without running it."""

    name: str
    description: str
    stages: tuple[Stage, ...]
    llm_calls: int


@dataclass(frozen=True)
class ReplicaDescription:
    """What the ingress needs of the replicas before it serves: their engine's name and tokenizer
    (admission counts prompt tokens as the replicas' engine does), the datastore, the pipelines."""

    engine: str | None
    tokenizer: Any
    datastore_info: DatastoreInfo
    pipelines: tuple[PipelineShape, ...]


class InferenceReplica:
    """One inference replica: the body of the `inference` deployment (`cluster.deploy`)."""

    async def __init__(self, settings: Settings, tier: bool) -> None:  # type: ignore[misc]  # Serve awaits it
        """`tier`: search through the retrieval tier deployed on this Ray cluster."""
        from ray import serve

        from telerag.server.process.runtime import load_runtime
        from telerag.server.ray_serve.tier import RetrievalTier

        self.id = serve.get_replica_context().replica_id.unique_id
        self.vectors: KnownVectors | None = None

        def known(embedder: Any) -> KnownVectors:
            self.vectors = KnownVectors(embedder)
            return self.vectors

        connect = functools.partial(RetrievalTier.connect, timeout_s=settings.cluster.shard_timeout_s)
        retrieval_tier = await asyncio.to_thread(connect) if tier else None  # it waits on the tier's answer
        tier_half = retrieval_tier.at if retrieval_tier else None
        self.runtime = runtime = await load_runtime(settings, cpu_half=tier_half, encoder=known)
        metrics = Metrics(runtime.cache_stats, runtime.prefix_cache_bytes, search_recall=runtime.search_recall)
        self.service = Service(runtime, metrics)
        if settings.server.warm_up:
            await self.service.warm_up()
        log.info("inference replica %s ready (%s)", self.id, "retrieval tier" if tier else "faiss here")

    def describe(self, route: RouteHint | None = None) -> ReplicaDescription:
        return ReplicaDescription(
            engine=self.runtime.engine_name,
            tokenizer=self.runtime.engine.tokenizer,  # type: ignore[attr-defined]  # both engines have one
            datastore_info=self.runtime.datastore_info,
            pipelines=tuple(PipelineShape(p.name, p.description, p.stages, p.llm_calls) for p in self.service.pipelines.values()),
        )

    async def run(
        self,
        pipeline: str,
        query: str,
        options: RunOptions,
        q_in: np.ndarray | None,
        seconds_left: float | None = None,
        route: RouteHint | None = None,
    ) -> AsyncGenerator[RunEvent, None]:
        """A pipeline run's events (admitted by the ingress); `q_in`: the question's vector;
        `seconds_left`: until its deadline (`shipped`)."""
        assert self.vectors is not None
        options = received(options, seconds_left)
        with self.vectors.given(query, q_in):
            async for event in event_stream(
                functools.partial(self.service.run, self.service.pipelines[pipeline], query, options)
            ):
                yield event

    def record_routing_stats(self) -> dict[str, Any]:
        """For the router, the clusters resident in this replica's cache; for the ingress's
        `/metrics`, this replica's series (compressed: they travel with every report)."""
        return {
            "clusters": self.runtime.resident_clusters(),
            "cache": self.runtime.cache_stats(),
            "metrics": zlib.compress(self.service.metrics.exposition()),
        }

    async def __del__(self) -> None:
        if hasattr(self, "runtime"):  # not when loading failed
            await self.runtime.close()


# -- the ingress's side ---------------------------------------------------------------------------


class QuestionPlacer:
    """q_in's vector and nearest clusters, computed once per request at the ingress, before routing."""

    def __init__(self, embedder: Any, centroids: np.ndarray, nearest: int) -> None:
        self.embedder, self.centroids, self.nearest = embedder, np.ascontiguousarray(centroids, dtype=np.float32), nearest
        self._lock = threading.Lock()  # a fast tokenizer is not to be used by two threads at once

    @classmethod
    def load(cls, settings: Settings) -> QuestionPlacer:
        """The configured embedder and the datastore's centroids (nothing else of it is read)."""
        from telerag.retrieval.datastore import Datastore
        from telerag.server.process.runtime import load_embedder

        embedder = load_embedder(settings.retrieval)
        datastore = Datastore.load(settings.retrieval.datastore.expanduser(), embedder=embedder.name, verify_checksums=False)
        return cls(embedder, np.array(datastore.centroids), settings.cluster.route_clusters)

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        with self._lock:
            return embedded(self.embedder, texts)

    def follow(self, datastore: Any) -> None:
        """Place questions on `datastore`'s lists from now on (a retrain's new centroids; a
        `retrieval.datastore.Datastore`)."""
        self.centroids = np.ascontiguousarray(datastore.centroids, dtype=np.float32)

    def place(self, text: str) -> tuple[np.ndarray, tuple[int, ...]]:
        vector = self.embed([text])[0]
        scores = self.centroids @ vector
        nearest = min(self.nearest, len(scores))
        top = np.argpartition(-scores, nearest - 1)[:nearest]
        return vector, tuple(int(c) for c in top[np.argsort(-scores[top], kind="stable")])


def shipped(options: RunOptions) -> tuple[RunOptions, float | None]:
    """A run's options as they travel to a replica, and the seconds left until its deadline: a
    replica may be on another machine, whose monotonic clock is its own, so the deadline travels
    as the time left (as gRPC's does), made an instant again there (`received`)."""
    if options.deadline is None:
        return options, None
    return replace(options, deadline=None), options.deadline - time.monotonic()


def received(options: RunOptions, seconds_left: float | None) -> RunOptions:
    """The options `shipped` sent, with the deadline an instant of this machine's clock again."""
    return options if seconds_left is None else replace(options, deadline=time.monotonic() + seconds_left)


def _lost_replica_errors() -> tuple[type[Exception], ...]:
    """What Ray and Serve raise for a call whose replica died or cannot be reached (its node
    lost): a call asked again elsewhere, unlike the replica's own error."""
    from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError
    from ray.serve.exceptions import DeploymentUnavailableError, ReplicaUnavailableError

    return (RayActorError, ActorDiedError, ActorUnavailableError, ReplicaUnavailableError, DeploymentUnavailableError)


class Replicas:
    """The inference deployment as the ingress calls it."""

    def __init__(self, handle: Any, placer: QuestionPlacer, attempts: int) -> None:
        self.handle, self.placer, self.attempts = handle, placer, attempts
        self.retries = 0  # runs asked again after their replica failed

    async def describe(self) -> ReplicaDescription:
        """What the replicas serve, asked again (1 s, 2 s... apart) while the replica asked is lost:
        an ingress started again after its node died may ask one there before Serve replaced it."""
        for attempt in range(1, self.attempts):
            with contextlib.suppress(*_lost_replica_errors()):
                return cast(ReplicaDescription, await self.handle.describe.remote())
            log.warning("inference replica lost while describing itself; asking again")
            await asyncio.sleep(attempt)
        return cast(ReplicaDescription, await self.handle.describe.remote())  # the last error as it came

    async def run(self, pipeline: str, query: str, options: RunOptions, key: str | None) -> AsyncGenerator[RunEvent, None]:
        """The run's events from the replica the router picks; asked again elsewhere if that
        replica fails before sending any."""
        from ray.exceptions import RayTaskError

        lost = _lost_replica_errors()
        vector, clusters = await asyncio.to_thread(self.placer.place, query)
        route = RouteHint(clusters=clusters, key=key)
        for attempt in range(1, self.attempts + 1):
            sent_options, seconds_left = shipped(options)
            stream = self.handle.options(stream=True).run.remote(
                pipeline, query, sent_options, vector, seconds_left, **{ROUTE_KWARG: route}
            )
            sent = False
            try:
                async for event in stream:
                    sent = True
                    yield event
                return
            except RayTaskError as exc:  # the run's own error, raised in the replica: as it was raised
                raise exc.cause from None
            except lost as exc:
                if sent or attempt == self.attempts:
                    what = "during its run" if sent else f"{attempt} times"
                    raise ReplicasUnavailable(f"the inference replica failed {what}: {type(exc).__name__}") from exc
                log.warning("inference replica lost before the run began (%s); asking again", type(exc).__name__)
                self.retries += 1
            finally:
                stream.cancel()  # a run left early (the client went away): the replica stops it

    def reports(self) -> dict[str, dict[str, Any]]:
        """Each live replica's latest routing stats (its clusters, cache and metrics)."""
        return REPLICA_STATS.of(REPLICAS)


class ReplicaPipeline:
    """A pipeline run on an inference replica (the `Pipeline` protocol)."""

    def __init__(self, shape: PipelineShape, replicas: Replicas, routing_key: Callable[[], str | None]) -> None:
        self.shape, self.replicas, self.routing_key = shape, replicas, routing_key

    @property
    def name(self) -> str:
        return self.shape.name

    @property
    def description(self) -> str:
        return self.shape.description

    @property
    def stages(self) -> tuple[Stage, ...]:
        return self.shape.stages

    @property
    def llm_calls(self) -> int:
        return self.shape.llm_calls

    def over(self, retriever: Retriever) -> Pipeline:
        raise VectorStoresUnavailable("a Ray cluster's inference replicas retrieve from their own datastore alone")

    async def run(self, query: str, options: RunOptions, emit: EventSink) -> RagResult:
        async with contextlib.aclosing(self.replicas.run(self.name, query, options, self.routing_key())) as events:
            async for event in events:
                if isinstance(event, ResultEvent):
                    return event.result
                emit(event)
        raise RuntimeError(f"the replica's run of {self.name} ended without a result")


class ReplicaRuntime:
    """What the ingress's service runs on (`service.ServedRuntime`): the inference replicas."""

    reranker = None  # not on a Ray cluster yet: the requests' rankings are made here, re-ranked by none

    def __init__(
        self,
        settings: Settings,
        description: ReplicaDescription,
        replicas: Replicas,
        routing_key: Callable[[], str | None] = lambda: None,
        writes: IngressWrites | None = None,
    ) -> None:
        """`writes`: the datastore's writer, the ingress's own (None: no documents are written)."""
        self.settings, self.description, self.replicas, self.routing_key = settings, description, replicas, routing_key
        self.writes = writes
        self._tokenizer_lock = threading.Lock()

    @property
    def datastore_info(self) -> DatastoreInfo:
        return self.description.datastore_info

    @property
    def engine_name(self) -> str | None:
        return self.description.engine

    def count_tokens(self, text: str) -> int:
        with self._tokenizer_lock:
            return len(self.description.tokenizer.encode(text, add_special_tokens=False))

    def serving_pipelines(self, on_batch: Callable[[str, int], None]) -> Mapping[str, ReplicaPipeline]:
        """Each replica batches its own retrieval (its batch sizes are in its series)."""
        return {shape.name: ReplicaPipeline(shape, self.replicas, self.routing_key) for shape in self.description.pipelines}

    def query_rewrite(self) -> None:
        return None  # no vector stores are served here (501), so no search's query to rewrite

    async def embed(self, texts: Sequence[str]) -> TextEmbeddings:
        placer = self.replicas.placer
        vectors = await asyncio.to_thread(placer.embed, texts)
        return TextEmbeddings(vectors, int(placer.embedder.count_tokens(texts)))

    def cache_stats(self) -> CacheStats:
        """The replicas' caches together (each one's own: the series labelled by replica)."""
        caches = [stats["cache"] for stats in self.replicas.reports().values() if "cache" in stats]
        return CacheStats(**{name: sum(getattr(c, name) for c in caches) for name in CacheStats.__dataclass_fields__})

    def prefix_cache_bytes(self) -> int | None:
        return None  # each replica's engine has its own: in its labelled series

    def search_recall(self) -> None:  # not estimated on a Ray cluster yet
        return None

    @property
    def documents(self) -> DocumentWriter | None:
        return None if self.writes is None else self.writes.documents

    @property
    def rebuilds(self) -> Rebuilds | None:
        return None if self.writes is None else self.writes.rebuilds

    @property
    def ingestion(self) -> None:
        return None  # a first run's ingestion ends before the replicas serve

    async def close(self) -> None:
        if self.writes is not None:
            await asyncio.to_thread(self.writes.close)
