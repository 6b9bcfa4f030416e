"""`telerag serve --ray`: the HTTP API on a Ray cluster (Chameleon's disaggregation on
Ray Serve). One Serve application, `telerag`: the ingress (the same FastAPI app, `app.create_app`,
behind Serve's HTTP proxy) and the inference replicas (`replicas.InferenceReplica`, routed by
`routing.ClusterRouter`); with `cluster.shards` > 0 the retrieval tier (`server.ray_serve.tier`) is a
second application the replicas search through.

The ingress admits for every replica (N x `scheduler.max_concurrency` running, N x `max_queue`
waiting; past that, 429 with Retry-After as one process answers), keeps the requests' metrics,
and reports both tiers in `/ready` and every replica's series in `/metrics`. Ray is imported only
when this runs.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import math
import os
import signal
import threading
import time
import zlib
from collections.abc import Iterator
from dataclasses import asdict
from typing import Any

from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Receive, Scope, Send

from telerag.config.settings import Settings
from telerag.server.protocols.ops import TierState
from telerag.server.ray_serve.replicas import REPLICAS, InferenceReplica, QuestionPlacer, ReplicaRuntime, Replicas
from telerag.server.ray_serve.router import ClusterRouter, RouterOptions
from telerag.server.ray_serve.routing import DECISIONS
from telerag.server.ray_serve.tier import TierShape, replica_scaling, tier_application
from telerag.server.ray_serve.writes import IngressWrites
from telerag.server.service import Service

log = logging.getLogger(__name__)

APP = "telerag"  # the Serve application: the ingress and the inference replicas
INGRESS = "ingress"
ROUTING_KEY_HEADER = b"x-routing-key"
TIERS_TTL_S = 1.0  # /ready asks Serve's controller at most this often

routing_key: contextvars.ContextVar[str | None] = contextvars.ContextVar("telerag_routing_key", default=None)


class RoutingKey:
    """A request's `X-Routing-Key` header, for the router (`routing.choose`): the requests that
    name one key go to one replica while the load is even."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            key = dict(scope.get("headers") or []).get(ROUTING_KEY_HEADER)
            routing_key.set(key.decode("latin-1")[:256] if key else None)
        await self.app(scope, receive, send)


class _Decisions(Collector):
    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(
            "telerag_routing_decisions", "inference requests routed, by the rule that chose", labels=["rule"]
        )
        for rule, count in DECISIONS.counts().items():
            family.add_metric([rule.value], float(count))
        yield family


def ingress_settings(settings: Settings) -> Settings:
    """The ingress admits for every replica: N times one replica's running and waiting requests,
    N the most replicas there may be (with autoscaling, what waits for a replica to start is in
    Serve's queue, which is what the autoscaler reads)."""
    scheduler, replicas = settings.scheduler, max(settings.cluster.replicas, settings.cluster.max_replicas)
    scaled = scheduler.model_copy(
        update={"max_concurrency": scheduler.max_concurrency * replicas, "max_queue": scheduler.max_queue * replicas}
    )
    return settings.model_copy(update={"scheduler": scaled})


class IngressStartFailed(RuntimeError):
    """The ingress's health check once its start failed: Serve replaces it."""


class ClusterIngress:
    """The ingress deployment's body: the app at once (`/health` answers, `/ready` says what is
    loading), its service once the replicas have described themselves and it has warmed up."""

    async def __init__(self, settings: Settings, replicas: Any, shards: int) -> None:  # type: ignore[misc]  # Serve awaits it
        """`replicas`: the inference deployment's handle."""
        from telerag.server.app import create_app

        self.settings, self.shards = ingress_settings(settings), shards
        self.fastapi = create_app(self.settings)
        self.fastapi.add_middleware(RoutingKey)
        self.fastapi.state.metrics.registry.register(_Decisions())
        self.fastapi.state.tiers = self.tiers
        self._tiers: tuple[float, list[TierState]] = (0.0, [])
        self._runtime: ReplicaRuntime | None = None
        self._loading = asyncio.create_task(self._load(replicas))

    async def __del__(self) -> None:
        """Serve stops the ingress: the writes queued end and the datastore's lock lets go."""
        if self._runtime is not None:
            await self._runtime.close()

    def check_health(self) -> None:
        """Serve's health check: an ingress whose start failed is unhealthy, so Serve starts
        another (it would otherwise answer 503 `loading` for ever)."""
        if self._loading.done() and not self._loading.cancelled() and (failed := self._loading.exception()) is not None:
            raise IngressStartFailed(f"the ingress could not start: {type(failed).__name__}: {failed}") from failed

    def __serve_build_asgi_app__(self) -> ASGIApp:
        return self.fastapi

    async def _load(self, handle: Any) -> None:
        app, settings = self.fastapi, self.settings
        lifecycle, metrics = app.state.lifecycle, app.state.metrics
        try:
            lifecycle.loading("loading embedder")
            placer = await asyncio.to_thread(QuestionPlacer.load, settings)
            replicas = Replicas(handle, placer, settings.cluster.attempts)
            lifecycle.loading("asking the inference replicas")
            description = await replicas.describe()
            lifecycle.loading("opening the datastore for writing")
            writes = await asyncio.to_thread(IngressWrites.open, settings, placer)
            self._runtime = ReplicaRuntime(settings, description, replicas, routing_key.get, writes)
            service = Service(self._runtime, metrics)
            metrics.replica_series = lambda: {
                replica: zlib.decompress(stats["metrics"]) for replica, stats in replicas.reports().items() if "metrics" in stats
            }
            if settings.server.warm_up:
                lifecycle.loading("warming up")
                await service.warm_up()
        except Exception as exc:
            log.exception("the ingress could not start")
            lifecycle.loading(f"failed: {type(exc).__name__}: {exc}")
            raise
        from telerag.server.app import publish

        publish(app, service)
        log.info("ingress ready: %d inference replicas, %d retrieval shards", settings.cluster.replicas, self.shards)

    async def tiers(self) -> list[TierState]:
        """Each deployment of both tiers, as Serve's controller last said (at most TIERS_TTL_S old)."""
        asked, tiers = self._tiers
        if time.monotonic() - asked > TIERS_TTL_S:
            tiers = await asyncio.to_thread(self._ask_tiers)
            self._tiers = (time.monotonic(), tiers)
        return tiers

    def _ask_tiers(self) -> list[TierState]:
        from ray import serve

        from telerag.server.ray_serve.tier import APP as TIER_APP

        applications = serve.status().applications
        wanted = [(APP, "ingress"), (APP, "inference")] + ([(TIER_APP, "retrieval")] if self.shards else [])
        states = []
        for app_name, tier in wanted:
            application = applications.get(app_name)
            for name, deployment in sorted((application.deployments if application else {}).items()):
                if (tier == "ingress") == (name == INGRESS) and (tier != "retrieval" or name.startswith("shard-")):
                    # keyed by Serve's `ReplicaState`, a str enum of a private module: compared by its value
                    running = sum(n for state, n in deployment.replica_states.items() if state == "RUNNING")
                    states.append(TierState(tier=tier, deployment=name, running=running, status=str(deployment.status.value)))
        if self.shards and not any(state.tier == "retrieval" for state in states):
            states.append(TierState(tier="retrieval", deployment=TIER_APP, running=0, status="NOT_DEPLOYED"))
        return states


def tier_shape(settings: Settings) -> TierShape:
    cluster = settings.cluster
    return TierShape(
        shards=cluster.shards,
        replicas=cluster.shard_replicas,
        cpus_per_replica=cluster.shard_cpus,
        max_replicas=cluster.max_shard_replicas,
        early_stop=settings.experiments.early_stop,
    )


def retrieval_application(settings: Settings) -> Any:
    """The retrieval tier's Serve application for `cluster.shards` > 0 (`server.ray_serve.tier`)."""
    return tier_application(
        settings.retrieval.datastore.expanduser(), tier_shape(settings), verify_checksums=settings.retrieval.verify_checksums
    )


def deploy(settings: Settings) -> None:
    """Deploy the retrieval tier (with `cluster.shards`) and the inference application on the Ray
    cluster this process is connected to, with Serve started; every replica runs when it returns."""
    from telerag.server.ray_serve.tier import deploy_tier

    if settings.cluster.shards:
        deploy_tier(
            settings.retrieval.datastore.expanduser(), tier_shape(settings), verify_checksums=settings.retrieval.verify_checksums
        )
    deploy_inference(settings)


def deploy_inference(settings: Settings) -> None:
    """Deploy (or replace: new replicas, cold caches) the inference application: the ingress and
    the replicas, which search through the tier deployed already where `cluster.shards` > 0."""
    from ray import serve

    serve.run(inference_application(settings), name=APP, route_prefix="/")


def inference_application(settings: Settings) -> Any:
    """The inference application (a Ray `Application`): the ingress in front of the replicas."""
    inference, ingress = inference_deployments(settings)
    return ingress.bind(settings, inference.bind(settings, settings.cluster.shards > 0), settings.cluster.shards)


def inference_deployments(settings: Settings) -> tuple[Any, Any]:
    """The inference application's Serve deployments, the replicas and then the ingress in front
    of them (as Serve lists an application's, what it calls first), shaped by the settings;
    unbound: what the Serve config file describes."""
    from ray import serve

    cluster = settings.cluster
    router = {
        "request_router_class": f"{ClusterRouter.__module__}.{ClusterRouter.__qualname__}",  # imported where it routes
        "request_router_kwargs": asdict(
            RouterOptions(
                deployment=REPLICAS,
                policy=cluster.router,
                balance_abs_threshold=cluster.balance_abs_threshold,
                balance_rel_threshold=cluster.balance_rel_threshold,
                recent_s=2 * cluster.routing_stats_period_s,
            )
        ),
        "request_routing_stats_period_s": cluster.routing_stats_period_s,
    }
    inference = serve.deployment(
        name=REPLICAS,
        **replica_scaling(cluster.replicas, cluster.max_replicas, settings.scheduler.max_concurrency),  # a replica's full batch
        ray_actor_options={"num_cpus": cluster.replica_cpus, "num_gpus": cluster.replica_gpus},
        max_ongoing_requests=settings.scheduler.max_concurrency,
        request_router_config=router,
        graceful_shutdown_timeout_s=settings.server.shutdown_grace_s,
    )(InferenceReplica)
    ingress = serve.deployment(
        name=INGRESS,
        ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=10_000,  # the ingress's own admission bounds what it takes (429 past it)
        graceful_shutdown_timeout_s=settings.server.shutdown_grace_s,
    )(serve.ingress()(ClusterIngress))
    return inference, ingress


def cpus_wanted(settings: Settings) -> float:
    """Ray's logical CPUs that every replica the settings may scale to asks for together."""
    cluster = settings.cluster
    most = max(cluster.replicas, cluster.max_replicas), max(cluster.shard_replicas, cluster.max_shard_replicas)
    return most[0] * cluster.replica_cpus + cluster.shards * most[1] * cluster.shard_cpus


def start_ray(settings: Settings, **options: Any) -> None:
    """Join the Ray cluster at RAY_ADDRESS, or start a local one whose logical CPUs fit every
    replica the settings ask for (on a small machine they share the cores anyway)."""
    import ray

    address = os.environ.get("RAY_ADDRESS")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    cpus = None if address else max(os.cpu_count() or 1, math.ceil(cpus_wanted(settings) + 1))
    ray.init(address=address, num_cpus=cpus, include_dashboard=False, configure_logging=False, **options)


def serve_on_ray(settings: Settings) -> int:
    """Start a local Ray cluster (or join RAY_ADDRESS) with Serve's HTTP proxy on the configured
    host and port, deploy both tiers, and serve until SIGTERM or SIGINT; then delete them (Serve
    drains each replica's requests for up to `server.shutdown_grace_s`)."""
    import ray
    from ray import serve

    from telerag.server.process.runtime import load_configured_datastore, load_embedder
    from telerag.server.ray_serve.tier import APP as TIER_APP

    if settings.retrieval.build_if_missing:  # built once here, not by every replica at once
        load_configured_datastore(
            settings.retrieval, load_embedder(settings.retrieval), early_stop=settings.experiments.early_stop
        ).close()
    start_ray(settings)
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):  # after ray.init, which installs its own
        signal.signal(signum, lambda received, _: stop.set())
    try:
        serve.start(http_options={"host": settings.server.host, "port": settings.server.port})
        deploy(settings)
        log.info(
            "serving on http://%s:%d: %d inference replicas, %s",
            settings.server.host,
            settings.server.port,
            settings.cluster.replicas,
            f"{settings.cluster.shards} retrieval shards" if settings.cluster.shards else "each searching its own faiss",
        )
        stop.wait()
        log.info("stopping: the replicas drain their requests")
        return 0
    finally:
        # bounded: a signal sent to the whole process group (a terminal's ^C) stops Ray's own
        # processes too, and Serve would then wait for them for ever
        def delete() -> None:
            for app_name in (APP, TIER_APP):
                if app_name in serve.status().applications:
                    serve.delete(app_name)

        deleting = threading.Thread(target=delete, daemon=True)
        deleting.start()
        deleting.join(settings.server.shutdown_grace_s + 15)
        ray.shutdown()
