"""What the ingress sends a replica for a run (`server.ray_serve.replicas`), against a stand-in for Serve's
deployment handle: the deadline travels as the time left, since a replica's clock is its own."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from telerag.pipelines.types import RunEvent, RunOptions, TokenEvent
from telerag.server.ray_serve.replicas import Replicas, received, shipped
from telerag.server.ray_serve.routing import ROUTE_KWARG

pytest.importorskip("ray", reason="the replicas need the `ray` extra")


class Handle:
    """Serve's deployment handle as `Replicas` calls it: `options(stream=True).run.remote(...)`."""

    def __init__(self) -> None:
        self.calls: list[tuple[tuple, dict]] = []
        self.run = self

    def options(self, **_: Any) -> Handle:
        return self

    def remote(self, *args: Any, **kwargs: Any) -> Stream:
        self.calls.append((args, kwargs))
        return Stream()


class Stream:
    """Serve's streamed response: the run's events; `cancel` stops the run in the replica."""

    async def __aiter__(self) -> AsyncIterator[RunEvent]:
        yield TokenEvent("an answer")

    def cancel(self) -> None:
        pass


class Placer:
    def place(self, text: str) -> tuple[np.ndarray, tuple[int, ...]]:
        return np.zeros(4, dtype=np.float32), (1, 2)


async def test_a_runs_deadline_reaches_the_replica_as_the_time_left_and_becomes_its_own_instant_there():
    handle = Handle()
    options = RunOptions(top_k=2, deadline=time.monotonic() + 10.0)
    events = [event async for event in Replicas(handle, Placer(), attempts=1).run("naive", "q?", options, key=None)]
    assert events == [TokenEvent("an answer")]
    ((args, kwargs),) = handle.calls
    pipeline, query, sent, _vector, seconds_left = args
    assert (pipeline, query, sent) == ("naive", "q?", replace(options, deadline=None)) and ROUTE_KWARG in kwargs
    assert 0 < seconds_left <= 10.0
    there = received(sent, seconds_left)
    assert there.deadline == pytest.approx(options.deadline, abs=1.0) and replace(there, deadline=None) == sent


def test_a_run_without_a_deadline_sends_none():
    assert shipped(RunOptions(top_k=2)) == (RunOptions(top_k=2), None)
    assert received(RunOptions(top_k=2), None) == RunOptions(top_k=2)


class Describing:
    """A handle whose `describe` fails `lost` times as a replica on a lost node does, then answers."""

    def __init__(self, lost: int) -> None:
        self.lost, self.asked = lost, 0
        self.describe = self

    async def remote(self) -> str:
        self.asked += 1
        if self.asked <= self.lost:
            from ray.exceptions import ActorDiedError

            raise ActorDiedError()
        return "description"


async def test_describing_the_replicas_asks_again_while_the_replica_asked_is_lost(monkeypatch):
    from ray.exceptions import ActorDiedError

    monkeypatch.setattr(asyncio, "sleep", _no_wait)
    handle = Describing(lost=2)
    assert await Replicas(handle, Placer(), attempts=3).describe() == "description" and handle.asked == 3
    with pytest.raises(ActorDiedError):  # every attempt lost: the last error, as it came
        await Replicas(Describing(lost=3), Placer(), attempts=3).describe()


async def _no_wait(_seconds: float) -> None:
    pass


async def test_an_ingress_whose_start_failed_fails_its_health_check_so_serve_replaces_it(tmp_path):
    from telerag.config.settings import Settings
    from telerag.pipelines.errors import EmbedderNotFound
    from telerag.server.ray_serve.applications import ClusterIngress, IngressStartFailed

    settings = Settings.model_validate({"retrieval": {"datastore": str(tmp_path / "ds"), "embedder": str(tmp_path / "none")}})

    class Collected(ClusterIngress):
        def __del__(self) -> None:  # type: ignore[override]  # Serve awaits the ingress's own; the collector would not
            pass

    ingress = Collected.__new__(Collected)
    await ingress.__init__(settings, Describing(lost=0), 0)  # as Serve builds it
    ingress.check_health()  # still loading: healthy
    with pytest.raises(EmbedderNotFound):
        await ingress._loading
    with pytest.raises(IngressStartFailed, match="could not start: EmbedderNotFound"):
        ingress.check_health()
