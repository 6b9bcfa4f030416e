"""The server process: listen at once, load after, serve, drain at SIGTERM. `telerag serve`
(`cli/serve.py`) runs it on the event loop of `server.process.event_loop`."""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import uvicorn
from fastapi import FastAPI

from telerag.config.settings import Settings
from telerag.engines.errors import EngineError
from telerag.pipelines.errors import PipelineError
from telerag.retrieval.corpus import WIKIPEDIA_SOURCE
from telerag.retrieval.datastore import MANIFEST, Manifest
from telerag.retrieval.errors import DatastoreError, RetrievalError
from telerag.server.admission.calibration import calibration_path, save_calibration
from telerag.server.observability.metrics import Metrics
from telerag.server.process.connections import uvicorn_options
from telerag.server.process.lifecycle import Lifecycle
from telerag.server.service import Service

if TYPE_CHECKING:
    pass  # imported when serving: it brings torch

log = logging.getLogger("telerag.server")


def uvicorn_config(app: FastAPI, settings: Settings) -> uvicorn.Config:
    """Everything the server asks of uvicorn, in one place."""
    return uvicorn.Config(
        app,
        host=settings.server.host,
        port=settings.server.port,
        log_level=settings.server.log_level,
        **uvicorn_options(settings.server, app.state.metrics.connections),
    )


class _Server(uvicorn.Server):
    """uvicorn's server, with SIGTERM and SIGINT left to the lifecycle (`serve` installs its
    handlers): uvicorn's own close the listener at the first signal and re-raise it at exit."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


async def serve(settings: Settings) -> int:
    """Listen at once, load after, serve, drain at SIGTERM; the process's exit status.

    `/health` answers from the start and `/ready` says what is loading; a load that fails
    stops the listener and returns 1 with the reason as one line. The first SIGTERM or SIGINT
    turns new work away (503) and waits up to `server.shutdown_grace_s` for the accepted
    requests, then returns 0; a second signal, or the end of the grace period, ends the process
    at once with status 1. A signal while loading stops at once with status 0."""
    from telerag.server.app import create_app, publish

    loop = asyncio.get_running_loop()
    lifecycle = Lifecycle()
    for signum in (signal.SIGINT, signal.SIGTERM):
        # Python-level handlers (as uvicorn's), not the loop's: an engine that adds its own to the
        # loop (SGLang does) can see them and put them back (engines/sglang.py).
        signal.signal(signum, lambda received, _: loop.call_soon_threadsafe(lifecycle.on_signal, received))
    app = create_app(settings, lifecycle)
    server = _Server(uvicorn_config(app, settings))
    listening = asyncio.create_task(_listen(server))
    while not server.started:
        if listening.done():  # uvicorn could not start (the port is taken, ...) and said why
            return 1
        await asyncio.sleep(0.01)
    log.info("listening on http://%s:%d; loading", settings.server.host, settings.server.port)

    loading = asyncio.create_task(_load(settings, lifecycle, app.state.metrics))
    await _first(loading, lifecycle.stop.wait())
    if not loading.done():
        log.info("stopped while loading (%s)", lifecycle.step)
        _exit_now(0)  # the load's thread cannot be interrupted, only left behind
    if (failure := loading.exception()) is not None:
        log.debug("start-up failed", exc_info=failure)
        log.error("start-up failed: %s", startup_failure(failure, settings.retrieval.datastore.expanduser()))
        server.should_exit = True
        await listening
        return 1
    service = loading.result()
    publish(app, service)
    log.info("ready")

    await _first(listening, lifecycle.stop.wait())
    if listening.done():  # uvicorn stopped by itself: an error
        await _close(app, service)
        listening.result()
        return 1
    lifecycle.drain()
    grace = settings.server.shutdown_grace_s
    deadline = loop.time() + grace
    drained = await _first(service.admission.drain(), lifecycle.force.wait(), deadline=deadline)
    if drained:
        server.should_exit = True
        drained = await _first(listening, lifecycle.force.wait(), deadline=deadline)
    if not drained:
        unfinished = service.admission.n_running + service.admission.n_waiting
        why = "at a second signal" if lifecycle.force.is_set() else f"after the {grace:g} s grace period"
        log.error("stopping %s with %d accepted request(s) unfinished", why, unfinished)
        _exit_now(1)
    await _close(app, service)
    log.info("stopped: every accepted request finished")
    return 0


def _calibration_file(service: Service) -> Path | None:
    """Where this server's admission measurements are kept across restarts (None: they are not)."""
    directory = service.settings.server.calibration_dir
    return None if directory is None else calibration_path(directory.expanduser(), service.settings, service.runtime.engine_name)


async def _close(app: FastAPI, service: Service) -> None:
    """Admission's measurements kept for the next start, the vector stores closed (the file being
    processed finished, their datastores let go), then the runtime whose embedder they used."""
    if (kept := _calibration_file(service)) is not None:
        try:
            await asyncio.to_thread(save_calibration, kept, service.calibration())
        except OSError as exc:
            log.warning("admission's measurements not kept in %s: %s", kept, exc)
    await asyncio.to_thread(app.state.vector_stores.close)
    await service.runtime.close()


async def _load(settings: Settings, lifecycle: Lifecycle, metrics: Metrics) -> Service:
    """The service over the loaded runtime, warmed up (unless `server.warm_up` is off: see
    `Service.warm_up`), then the rest of its datastore's corpus written while it serves (on the
    embedded default's first run: `Runtime.ingestion`)."""
    # imported here, in a thread: it brings torch (seconds), and `/health` answers meanwhile.
    # The module's attribute is looked up, not imported by name: a test launcher may replace it.
    lifecycle.loading("loading libraries")
    runtime_module = await asyncio.to_thread(importlib.import_module, "telerag.server.process.runtime")
    runtime = await runtime_module.load_runtime(settings, lifecycle, writable=settings.documents.writable)
    service = Service(runtime, metrics)
    kept = _calibration_file(service)
    measured = kept is not None and service.restore_calibration(kept)
    if settings.server.warm_up:
        lifecycle.loading("warming up")
        try:
            await service.warm_up(measured=measured)
        except BaseException:
            await runtime.close()
            raise
    if runtime.ingestion is not None:
        runtime.ingestion.start()
    return service


async def _listen(server: uvicorn.Server) -> None:
    """uvicorn's `serve`, which ends the process (SystemExit) when it cannot start: here it ends
    only this task, after uvicorn has logged why."""
    with contextlib.suppress(SystemExit):
        await server.serve()


async def _first(awaited: Awaitable[Any], interrupt: Awaitable[Any], *, deadline: float | None = None) -> bool:
    """Wait for `awaited` until `interrupt` happens or the loop's clock reaches `deadline`;
    whether `awaited` finished (it is left running otherwise)."""
    main = asyncio.ensure_future(awaited)
    stop = asyncio.ensure_future(interrupt)
    timeout = None if deadline is None else max(0.0, deadline - asyncio.get_running_loop().time())
    try:
        await asyncio.wait({main, stop}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stop.cancel()
    return main.done()


def _exit_now(status: int) -> NoReturn:
    """End the process without waiting for threads still working (a load, a generation)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def startup_failure(error: BaseException, datastore: Path) -> str:
    """Why start-up failed, as one line for the operator; for a datastore that is damaged,
    missing or built for another embedder, with the command that rebuilds it."""
    typed = isinstance(error, RetrievalError | PipelineError | EngineError)
    message = " ".join((str(error) if typed else f"{type(error).__name__}: {error}").split())
    if isinstance(error, DatastoreError) and (command := rebuild_command(datastore)):
        message += f"; to rebuild it: {command}"
    return message


def rebuild_command(path: Path) -> str | None:
    """The `telerag datastore build` command that (re)builds the datastore at `path`, from what
    its manifest says it was built from; None where no build may write (a user's directory)."""
    from telerag.pipelines.embedder import DEFAULT_NAME

    if (path / MANIFEST).is_file():
        try:
            manifest = Manifest.read(path)
            source, embedder = manifest.source, manifest.embedder
        except DatastoreError:
            source, embedder = "", DEFAULT_NAME
        overwrite = " --overwrite"
    elif not path.exists() or (path.is_dir() and not any(path.iterdir())):
        source, embedder, overwrite = "", DEFAULT_NAME, ""
    else:
        return None
    what = "--wikipedia" if source == WIKIPEDIA_SOURCE else f"--corpus {source}" if source else "--corpus FILE (or --wikipedia)"
    model = "" if embedder == DEFAULT_NAME else f" --embedder DIR (the model {embedder})"
    return f"telerag datastore build {what}{model} --out {path}{overwrite}"
