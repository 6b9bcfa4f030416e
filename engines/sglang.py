"""SGLang in the server process (`sglang.Engine`), behind the `Engine` protocol: the production
engine on a GPU. SGLang batches concurrent requests itself (continuous batching, RadixAttention
prefix cache); this adapter only translates our SamplingParams into its `sampling_params` and
its streamed output dicts into our TokenChunks and Generations.

What `Engine.async_generate(prompt=[...], stream=True)` yields (sglang 0.5, with the default
`incremental_streaming_output=False`): one dict per new output of one prompt, `index` naming
the prompt, `text` and `output_ids` cumulative, and `meta_info` with `prompt_tokens`,
`completion_tokens`, `finish_reason` (None until the last dict; then `{"type": "stop" |
"length" | "abort", "matched": ..., "message": ..., "status_code": ...}`) and, with
`return_logprob`, `output_token_logprobs` (cumulative `(logprob, token_id, text)` triples).
SGLang trims a matched stop string from the final text, but may already have streamed its
first characters; the shared StopFilter holds such a tail back, so streamed text is always a
prefix of the final one. Closing the stream makes SGLang abort the request.

SGLang is written to own its process; in ours it must leave the server's state alone (read
against sglang 0.5.23, `srt/entrypoints/engine.py` and `srt/managers/tokenizer_manager.py`):
- signals: `Engine()` installs a SIGQUIT handler, and the first request installs SIGTERM and
  SIGQUIT handlers on the event loop (`TokenizerManager.auto_create_handle_loop`) whose SIGTERM
  drains only SGLang's requests and then kills the process tree, skipping the server's drain.
  The adapter starts that loop itself, once, and puts the process's handlers back both times.
  SIGQUIT is also how SGLang's subprocesses report a crash: it then ends the server by the
  default action (not a drain: the engine is gone), and the subprocesses die with it.
- logging: `Engine()` calls `logging.basicConfig(level=log_level, force=True)` (level "error"
  when none is given), replacing the root logger's handlers. The adapter passes this
  process's level (SGLang's subprocesses log at it) and keeps the root logger as it was.
- BOS: SGLang tokenises a text prompt with the tokenizer's special tokens, so a chat template
  rendered to text (which writes BOS itself) would start with two. The adapter sends token ids
  (`prompt_token_ids`: the chat template's own ids, one BOS).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import signal
import threading
import time
from collections.abc import AsyncGenerator, Iterator, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from telerag.engines import StopFilter, format_chat, prompt_token_ids
from telerag.engines.errors import EngineError, EngineOverloaded, EngineUnavailable, GenerationAborted
from telerag.engines.types import FinishReason, Generation, OnChunk, SamplingParams, Streamed, TokenChunk, deadline_passed

OVERLOADED = (429, 503)  # the status codes SGLang gives an abort for lack of room or time
HOST_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGQUIT)  # whose handlers SGLang must not keep


TOP_P_FLOOR = 1e-6


def sampling_params(params: SamplingParams) -> dict[str, Any]:
    """Our SamplingParams as SGLang's `sampling_params` (temperature 0 is greedy in both)."""
    return {
        "max_new_tokens": params.max_tokens,
        "temperature": params.temperature,
        "top_p": max(params.top_p, TOP_P_FLOOR),  # SGLang refuses 0; a nucleus this small is the top token, as 0 is
        "stop": list(params.stop) or None,
    }


@dataclass
class _Progress:
    """What one prompt's stream has delivered so far."""

    text: StopFilter
    seen_text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    ttft_ms: float = 0.0
    done: bool = False
    prompt_tokens: int = 0  # as sent (SGLang's own count comes with the last dict)


@dataclass
class _Stop:
    """Whether a call's caller asked for no more (`Engine.generate`'s `on_chunk`)."""

    asked: bool = False


class SGLangEngine:
    """An in-process `sglang.Engine` (it starts its scheduler and detokenizer subprocesses)."""

    def __init__(
        self,
        model_path: str,
        *,
        mem_fraction_static: float | None = None,
        context_length: int | None = None,
        tp_size: int = 1,
        log_level: str | None = None,
        name: str | None = None,
        module: ModuleType | None = None,
        **engine_args: Any,
    ) -> None:
        """`mem_fraction_static` is the share of GPU memory SGLang takes for weights and KV
        cache: leave room for the retrieval cluster cache. `log_level` is SGLang's (None: the
        level this process logs at). `engine_args` go to `sglang.Engine` as they are (its
        ServerArgs); `module` replaces `import sglang` (tests)."""
        sglang = module or _import_sglang()
        if log_level is None:
            log_level = logging.getLevelName(logging.getLogger().getEffectiveLevel()).lower()
        args = {"model_path": model_path, "tp_size": tp_size, "log_level": log_level, **engine_args}
        if mem_fraction_static is not None:
            args["mem_fraction_static"] = mem_fraction_static
        if context_length is not None:
            args["context_length"] = context_length
        args["incremental_streaming_output"] = False  # the cumulative chunks this adapter reads
        try:
            with _process_state_kept():
                self.engine = sglang.Engine(**args)
        except Exception as exc:  # a failed start is one error to the caller
            raise EngineUnavailable(f"SGLang could not load {model_path}: {exc}") from exc
        self.tokenizer = self.engine.tokenizer_manager.tokenizer
        self.name = name or model_path.rstrip("/").rsplit("/", 1)[-1]
        self._output_loop_started = False

    # -- the Engine protocol ------------------------------------------------------------------

    def format_prompt(self, user_text: str, *, system: str = "") -> str:
        return format_chat(self.tokenizer, user_text, system)

    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)

    async def generate(self, prompts: Sequence[str], params: SamplingParams, on_chunk: OnChunk | None = None) -> list[Generation]:
        stop = _Stop()
        generations: dict[int, Generation] = {}
        async with contextlib.aclosing(self._items(prompts, params, stop)) as items:
            async for item in items:
                if isinstance(item, Generation):
                    generations[item.index] = item
                elif on_chunk is not None and not stop.asked and on_chunk(item):
                    stop.asked = True
        return [generations[i] for i in range(len(prompts))]

    async def prefill(self, prompts: Sequence[str]) -> list[Generation]:
        """A request of no new tokens: SGLang prefills it into its radix cache and ends it
        (`Req.is_prefill_only`)."""
        return await self.generate(prompts, SamplingParams(max_tokens=0))

    def stream(self, prompts: Sequence[str], params: SamplingParams) -> AsyncGenerator[Streamed, None]:
        return self._items(prompts, params, _Stop())

    async def _items(self, prompts: Sequence[str], params: SamplingParams, stop: _Stop) -> AsyncGenerator[Streamed, None]:
        """The call's chunks and Generations; once `stop` is asked, the unfinished prompts end
        with what they have ("stop") and SGLang aborts the rest as the stream closes."""
        if not prompts:
            return
        started = time.perf_counter()
        input_ids = [prompt_token_ids(self.tokenizer, p) for p in prompts]
        progress = [_Progress(StopFilter(params.stop), prompt_tokens=len(ids)) for ids in input_ids]
        if deadline_passed(params.deadline):  # nothing to send it for
            for item in _cut(progress, params, started, "deadline"):
                yield item
            return
        self._start_output_loop()
        try:
            outputs = await self.engine.async_generate(
                input_ids=input_ids, sampling_params=sampling_params(params), return_logprob=params.logprobs, stream=True
            )
        except Exception as exc:  # SGLang's own errors become ours
            raise _engine_error(exc) from exc
        until = None if params.deadline is None else asyncio.get_running_loop().time() + params.deadline - time.monotonic()
        try:
            while True:
                try:  # the request is checked (and may be refused) at the first step
                    async with asyncio.timeout_at(until):  # around the wait only: never across a yield
                        out = await outputs.__anext__()
                except StopAsyncIteration:
                    break
                except TimeoutError:  # its deadline came: each unfinished prompt ends with what it has
                    for item in _cut(progress, params, started, "deadline"):
                        yield item
                    break
                except Exception as exc:
                    raise _engine_error(exc) from exc
                for item in _translate(out, progress, params, started):
                    yield item
                if stop.asked:  # its caller wants no more: the same
                    for item in _cut(progress, params, started, "stop"):
                        yield item
                    break
        finally:
            await outputs.aclose()  # SGLang aborts what is still running
        missing = [i for i, p in enumerate(progress) if not p.done]
        if missing:
            raise EngineError(f"SGLang's stream ended without finishing prompts {missing}")

    async def close(self) -> None:
        await asyncio.to_thread(self.engine.shutdown)

    def _start_output_loop(self) -> None:
        """Start SGLang's output loop on this event loop before the first request does, with
        the process's signal handlers kept (see the module's docstring)."""
        if self._output_loop_started:
            return
        with _process_state_kept(asyncio.get_running_loop()):
            self.engine.tokenizer_manager.auto_create_handle_loop()
        self._output_loop_started = True


@contextlib.contextmanager
def _process_state_kept(loop: asyncio.AbstractEventLoop | None = None) -> Iterator[None]:
    """The process's handlers of HOST_SIGNALS and its root logger (handlers, level) as they
    were before the block. A handler SGLang added to `loop` is removed from it too: the loop
    would still call it for a signal caught by any Python handler. Signal handlers belong to
    the main thread; elsewhere SGLang installs none and only the logger is kept."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    main = threading.current_thread() is threading.main_thread()
    before = {sig: signal.getsignal(sig) for sig in HOST_SIGNALS} if main else {}
    try:
        yield
    finally:
        for added in [h for h in root.handlers if h not in handlers]:
            added.close()
        root.handlers[:] = handlers
        root.setLevel(level)
        for sig, handler in before.items():
            if handler is None or signal.getsignal(sig) == handler:
                continue  # unchanged, or installed outside Python (nothing to restore it with)
            if loop is not None:
                loop.remove_signal_handler(sig)
            signal.signal(sig, handler)


def _translate(out: dict[str, Any], progress: list[_Progress], params: SamplingParams, started: float) -> list[Streamed]:
    """One SGLang output dict as our items: the new text and tokens as a TokenChunk and, on the
    last dict of a prompt, its Generation."""
    index = int(out.get("index", 0))
    meta = out["meta_info"]
    state = progress[index]
    now = time.perf_counter()
    text = out.get("text") or ""
    ids = list(out.get("output_ids") or [])
    new_ids = ids[len(state.token_ids) :]
    new_logprobs = [float(lp) for lp, *_ in (meta.get("output_token_logprobs") or [])[len(state.logprobs) :]]
    piece = state.text.push(text[len(state.seen_text) :]) if text.startswith(state.seen_text) else ""
    state.seen_text, state.token_ids, state.logprobs = text, ids, state.logprobs + new_logprobs
    if new_ids and not state.ttft_ms:
        state.ttft_ms = (now - started) * 1e3
    items: list[Streamed] = []
    if piece or new_ids:
        items.append(
            TokenChunk(index=index, text=piece, token_ids=tuple(new_ids), logprobs=tuple(new_logprobs) if params.logprobs else ())
        )
    finish = meta.get("finish_reason")
    if not finish:
        return items
    reason = finish.get("type")
    if reason == "abort":
        raise _abort_error(finish)
    matched = finish.get("matched")
    state.prompt_tokens = int(meta.get("prompt_tokens", state.prompt_tokens))
    cached = int(meta.get("cached_tokens") or 0)  # its radix cache's hit, per request
    completion = int(meta.get("completion_tokens", len(ids)))
    ended: FinishReason = "length" if reason == "length" else "stop"
    matched = matched if isinstance(matched, str) else None
    return items + _finished(state, index, ended, params, started, matched, cached, completion)


def _cut(progress: list[_Progress], params: SamplingParams, started: float, reason: FinishReason) -> list[Streamed]:
    """The unfinished prompts' end before SGLang's (their deadline, or their caller wants no
    more), each with what it has generated so far (SGLang aborts the rest when the stream closes)."""
    return [
        item
        for index, state in enumerate(progress)
        if not state.done
        for item in _finished(state, index, reason, params, started, None, 0, len(state.token_ids))
    ]


def _finished(
    state: _Progress,
    index: int,
    reason: FinishReason,
    params: SamplingParams,
    started: float,
    matched: str | None,
    cached: int,
    completion: int,
) -> list[Streamed]:
    """The held-back tail of a prompt's text, if any, and its Generation."""
    tail = state.text.finish(matched)
    state.done = True
    generation = Generation(
        text=state.text.final,
        prompt_tokens=state.prompt_tokens,
        cached_tokens=cached,
        completion_tokens=completion,
        finish_reason=reason,
        ttft_ms=state.ttft_ms,
        total_ms=(time.perf_counter() - started) * 1e3,
        token_ids=tuple(state.token_ids),
        logprobs=tuple(state.logprobs) if params.logprobs else (),
        index=index,
    )
    return [TokenChunk(index=index, text=tail), generation] if tail else [generation]


def _engine_error(exc: Exception) -> EngineError:
    """An exception out of SGLang as ours: a ValueError is its word for a request it refuses
    (too long for the context, bad sampling parameters)."""
    if isinstance(exc, ValueError):
        return EngineError(f"SGLang refused the request: {exc}")
    return EngineError(f"SGLang failed: {exc}")


def _abort_error(finish: dict[str, Any]) -> EngineError:
    """The typed error for a request SGLang aborted on its own: overloaded (no room, timed
    out in the queue), refused (a 4xx), or aborted for another reason."""
    message = f"SGLang aborted the request: {finish.get('message') or 'no reason given'}"
    status = finish.get("status_code")
    if status in OVERLOADED:
        return EngineOverloaded(message)
    if status is not None:
        return EngineError(message)
    return GenerationAborted(message)


def _import_sglang() -> ModuleType:
    """`sglang`, imported only when an SGLangEngine is made: it needs CUDA and is an optional
    extra, and everything else must import without it."""
    try:
        return importlib.import_module("sglang")
    except Exception as exc:  # ImportError, or a broken CUDA install under it
        raise EngineUnavailable(
            f"SGLang is not available ({exc}); install the 'sglang' extra on a CUDA machine, or use the transformers engine"
        ) from exc
