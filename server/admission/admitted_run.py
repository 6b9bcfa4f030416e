"""One admitted request's pipeline run, and the one place that owns its admission ticket and its
cancellation, whether the answer goes back as one JSON body or as a stream of events (or, for the
server's own warm-up, as the result alone).

The run is a task of its own: it waits for a slot, then runs the pipeline, whose events go into
the one queue the response reads (a token crosses it once, from the run to the response). Beside
it a task waits on the client's connection (`request.receive()` returns `http.disconnect` when the
client goes away) and cancels the run at once: the LLM call is aborted, the clusters it pinned
are released, its slot is freed. A response that stops reading (the stream's client left, or the
handler was cancelled) cancels the run as well.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel

from telerag.pipelines.types import RagResult, ResultEvent, RunBody, RunEvent
from telerag.server import errors
from telerag.server.admission.deadline import AdmissionTicket
from telerag.server.admission.policy import AdmissionPolicy
from telerag.server.admission.workload import ServedWork
from telerag.server.protocols.common import ErrorDetail

CLIENT_CLOSED_REQUEST = 499  # nobody reads it: the status for a response whose client left first


class ClientDisconnected(Exception):
    """The client went away before its run ended."""


@dataclass(frozen=True)
class EventStream:
    """How one API writes a run as server-sent events."""

    events: Callable[[AsyncIterator[RunEvent]], AsyncGenerator[bytes, None]]  # the run's events, as they come
    error: Callable[[ErrorDetail], bytes]  # a failure after the stream began
    end: bytes | None = None  # last, whether the run completed or failed


@dataclass(frozen=True)
class _Failed:
    error: Exception


_Item = RunEvent | _Failed | None  # what the run puts in its queue; None: the run is over


class AdmittedRun:
    """A `run` for an admitted `ticket`; it starts at once (waiting for a slot)."""

    def __init__(
        self,
        request: Request | None,
        admission: AdmissionPolicy,
        ticket: AdmissionTicket,
        run: RunBody,
        served: Callable[[ServedWork], None] = lambda work: None,
    ) -> None:
        """`request`: the client's, whose leaving cancels the run (None: the server's own, no
        client); `served` hears what a completed run was served, once, as its ticket finishes."""
        self._request, self._admission, self._ticket, self._served = request, admission, ticket, served
        self._queue: asyncio.Queue[_Item] = asyncio.Queue()
        self._settled = asyncio.Event()  # it holds a slot, or it ended without one
        self._started = self._client_left = False
        self._result: RagResult | None = None  # once the run has completed
        self._task = asyncio.create_task(self._run(run))
        self._task.add_done_callback(self._ended)  # a callback: it runs even if the task is cancelled before it began
        self._watcher = None if request is None else asyncio.create_task(self._cancel_on_disconnect(request))

    # -- the two ways an answer goes back ---------------------------------------------------------

    async def respond(self, body: Callable[[RagResult], BaseModel]) -> Response:
        """The run to its end, answered as `body(result)` in JSON; its error raised for the app's
        error handlers."""
        try:
            result = await self.result()
        except ClientDisconnected:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        return Response(body(result).model_dump_json(), media_type="application/json")

    async def result(self) -> RagResult:
        """The run to its end (its ticket finished); its error raised."""
        try:
            # the run to its end first, then its events at once: one wake-up for the whole run,
            # not one per token
            await asyncio.wait({self._task})
            async for _ in self._read():
                pass
        finally:
            await self._close()
        if self._result is None:
            raise RuntimeError("the pipeline ended without a result")
        return self._result

    async def stream(self, form: EventStream) -> Response:
        """The run's events as `form` writes them, once it holds a slot (the status line waits
        for it, so a client that leaves meanwhile frees its place in the queue)."""
        try:
            await self._settled.wait()
        except BaseException:
            await self._close()
            raise
        if not self._started:
            await self._close()
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        return StreamingResponse(self._written(form), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    async def _written(self, form: EventStream) -> AsyncIterator[bytes]:
        try:
            async with contextlib.aclosing(form.events(self._read())) as chunks:
                async for chunk in chunks:
                    yield chunk
        except ClientDisconnected:
            return
        except Exception as exc:  # noqa: BLE001 - after the stream began, errors travel in the stream
            yield form.error(errors.error_detail(exc))
        finally:
            await self._close()
        if form.end is not None:
            yield form.end

    # -- the run --------------------------------------------------------------------------------

    async def _read(self) -> AsyncIterator[RunEvent]:
        """The pipeline's events as they come; its error if it fails; `ClientDisconnected` if the
        client left first."""
        while (item := await self._queue.get()) is not None:
            if isinstance(item, _Failed):
                raise item.error
            yield item
        if self._client_left:
            raise ClientDisconnected

    async def _close(self) -> None:
        """Cancel the run unless it has ended, and wait until it has (its ticket finished, its
        clusters released)."""
        if not self._task.done():
            self._task.cancel()
            await asyncio.wait({self._task})

    async def _run(self, run: RunBody) -> None:
        """Wait for a slot, then run the pipeline, its events into the queue; completed once the
        result came."""
        await self._admission.start(self._ticket)
        self._started = True
        self._settled.set()
        try:
            self._result = await run(self._queue.put_nowait)
        except Exception as exc:  # noqa: BLE001 - handed to the reader of the queue
            self._queue.put_nowait(_Failed(exc))
        else:
            self._queue.put_nowait(ResultEvent(self._result))

    def _ended(self, _: asyncio.Task[None]) -> None:
        """The run is over, however it ended: its ticket finishes, and its readers learn it."""
        served = None if self._result is None else ServedWork.of(self._result)
        self._admission.finish(self._ticket, completed=served is not None, served_work=None if served is None else served.work)
        if served is not None:
            self._served(served)
        self._settled.set()
        self._queue.put_nowait(None)
        if self._watcher is not None:
            self._watcher.cancel()

    async def _cancel_on_disconnect(self, request: Request) -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        self._client_left = True
        self._task.cancel()
