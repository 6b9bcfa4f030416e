"""What the engine's worker keeps per caller and per prompt: where a caller's output goes, and
each prompt's tokens, log-probabilities and text as it decodes (see `transformers`)."""

from __future__ import annotations

import asyncio
import contextvars
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from telerag.engines import StopFilter
from telerag.engines.transformers.document_kv import ChunkedIds
from telerag.engines.types import Generation, OnChunk, SamplingParams, Streamed, TokenChunk, deadline_passed

Item = Streamed | BaseException  # what the worker hands a caller: its chunks and Generations, or its failure


@dataclass(eq=False)
class StreamCall:
    """One caller's call: where its output goes and whether it still wants it."""

    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    deliver: Callable[[Item], None]  # called on `loop` with each item, in order
    context: contextvars.Context = field(default_factory=contextvars.copy_context)  # the caller's: `deliver` runs in it
    submitted: float = field(default_factory=time.perf_counter)
    abort: threading.Event = field(default_factory=threading.Event)  # nobody listens: its rows are dropped
    stop: threading.Event = field(default_factory=threading.Event)  # it needs no more: its rows end ("stop")

    def emit(self, item: Item) -> None:
        """Hand an item to the caller's event loop (from the worker thread)."""
        if self.abort.is_set():
            return
        try:
            self.loop.call_soon_threadsafe(self.deliver, item, context=self.context)
        except RuntimeError:  # the caller's loop is closed: nobody is listening any more
            self.abort.set()


class Collected:
    """A `generate` call's side on the caller's loop: each chunk to its `on_chunk` straight from
    the worker's hand-off, the Generations gathered into `done` (or the call's failure)."""

    def __init__(self, n_prompts: int, on_chunk: OnChunk | None, loop: asyncio.AbstractEventLoop) -> None:
        self.n_prompts = n_prompts
        self.on_chunk = on_chunk
        self.stop = threading.Event()  # the call's `StreamCall.stop`
        self.done: asyncio.Future[list[Generation]] = loop.create_future()
        self._generations: dict[int, Generation] = {}

    def take(self, item: Item) -> None:
        if self.done.done():
            return
        if isinstance(item, BaseException):
            self.done.set_exception(item)
        elif isinstance(item, Generation):
            self._generations[item.index] = item
            if len(self._generations) == self.n_prompts:
                self.done.set_result([self._generations[i] for i in range(self.n_prompts)])
        elif self.on_chunk is not None and not self.stop.is_set():
            try:
                if self.on_chunk(item):
                    self.stop.set()
            except Exception as exc:  # noqa: BLE001 - the caller's own failure ends its call
                self.stop.set()
                self.done.set_exception(exc)


@dataclass(eq=False)
class PromptRow:
    """One prompt of a call, waiting in the queue."""

    call: StreamCall
    index: int
    prompt_ids: list[int]
    chunked: ChunkedIds | None = None  # its documents' ids, where the engine reuses per-document KV


class Detokenizer:
    """The text of a growing token list, a piece per token, without decoding everything again
    each step. The last few tokens are decoded with one token of context before them (the
    prefix-offset method of TGI and vLLM), so word-leading spaces come out right, and a piece
    ending in an unfinished UTF-8 character waits for the token that completes it."""

    def __init__(self, decode: Callable[[Sequence[int]], str]) -> None:
        self.decode = decode
        self.ids: list[int] = []
        self.prefix = 0
        self.read = 0

    def push(self, token: int) -> str:
        self.ids.append(token)
        return self._advance(final=False)

    def flush(self) -> str:
        """What is left at the end, even an unfinished character."""
        return self._advance(final=True)

    def _advance(self, *, final: bool) -> str:
        before = self.decode(self.ids[self.prefix : self.read])
        after = self.decode(self.ids[self.prefix :])
        if len(after) <= len(before) or (after.endswith("\ufffd") and not final):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return after[len(before) :]


class DecodingRow:
    """One row of the running batch: its tokens, log-probabilities and text so far."""

    def __init__(self, row: PromptRow, decode: Callable[[Sequence[int]], str], max_tokens: int) -> None:
        self.row = row
        self.params = row.call.params
        self.prompt_tokens = len(row.prompt_ids)
        self.cached_tokens = 0  # of them, taken from the prefix cache
        self.max_tokens = max_tokens
        self.detokenizer = Detokenizer(decode)
        self.text = StopFilter(self.params.stop)
        self.logprobs: list[float] = []
        self.ttft_ms = 0.0

    @property
    def tokens(self) -> list[int]:
        return self.detokenizer.ids

    def advance(self, token: int, logprob: float, eos: set[int], now: float) -> str | None:
        """Take the row's next token; emits its chunk and returns the finish reason, if it finished."""
        call = self.row.call
        if call.stop.is_set():  # its caller needs no more: this token is not taken
            return self.finish("stop", now)
        if not self.ttft_ms:
            self.ttft_ms = (now - call.submitted) * 1e3
        if token in eos:
            return self.finish("stop", now)
        piece = self.text.push(self.detokenizer.push(token))
        self.logprobs.append(logprob)
        call.emit(
            TokenChunk(
                index=self.row.index,
                text=piece,
                token_ids=(token,),
                logprobs=(logprob,) if self.params.logprobs else (),
            )
        )
        if self.text.stopped:
            return self.finish("stop", now)
        if len(self.tokens) >= self.max_tokens:
            return self.finish("length", now)
        if deadline_passed(self.params.deadline):
            return self.finish("deadline", now)
        return None

    def finish(self, reason: str, now: float) -> str:
        """Emit the rest of the text and the row's Generation."""
        call = self.row.call
        if not self.text.stopped:
            self.text.push(self.detokenizer.flush())
        tail = self.text.finish()
        if tail:
            call.emit(TokenChunk(index=self.row.index, text=tail))
        call.emit(
            Generation(
                text=self.text.final,
                prompt_tokens=self.prompt_tokens,
                cached_tokens=self.cached_tokens,
                completion_tokens=len(self.tokens),
                finish_reason=reason,  # type: ignore[arg-type]
                ttft_ms=self.ttft_ms,
                total_ms=(now - call.submitted) * 1e3,
                token_ids=tuple(self.tokens),
                logprobs=tuple(self.logprobs) if self.params.logprobs else (),
                index=self.row.index,
            )
        )
        return reason
