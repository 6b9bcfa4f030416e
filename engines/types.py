"""The contract between an LLM engine and its callers: the `Engine` protocol, how to decode
(`SamplingParams`), and what a generation streams and ends with (`TokenChunk`, `Generation`).

Plain data and a Protocol, so that the pipelines, the server and the tests drive an engine
without knowing which one sits behind it.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

# Why an LLM call ended: of itself (an end token or a stop string), at its token limit, at the
# run's deadline (`SamplingParams.deadline`; a call begun after it generates nothing), or aborted.
FinishReason = Literal["stop", "length", "deadline", "abort"]


@dataclass(frozen=True)
class SamplingParams:
    """How to decode. `temperature == 0` means greedy."""

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    logprobs: bool = False
    deadline: float | None = None  # a time.monotonic() instant: generation stops there ("deadline")


def deadline_passed(deadline: float | None) -> bool:
    """Whether a deadline (a `time.monotonic()` instant; None: none) has come."""
    return deadline is not None and time.monotonic() >= deadline


@dataclass(frozen=True)
class TokenChunk:
    """One streamed piece of a generation: the new text and, if asked for, each new token's log-probability."""

    index: int  # which prompt of the batch this belongs to
    text: str
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[float, ...] = ()


@dataclass(frozen=True)
class Generation:
    """A finished generation of one prompt."""

    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: FinishReason
    ttft_ms: float
    total_ms: float
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[float, ...] = ()  # one per completion token when SamplingParams.logprobs
    index: int = 0  # which prompt of the batch this is
    cached_tokens: int = 0  # of prompt_tokens, those whose KV the engine reused instead of prefilling


Streamed = TokenChunk | Generation  # what a call streams: its chunks, and each prompt's Generation as it ends


# What a caller of `Engine.generate` hears of each TokenChunk as it is made, on its own event loop:
# True when the call needs no more (each of its prompts then ends there, as a stop string ends it).
OnChunk = Callable[[TokenChunk], bool | None]


@runtime_checkable
class Engine(Protocol):
    """An LLM. Implementations: `engines.transformers.engine.TransformersEngine`, `engines.sglang.SGLangEngine`."""

    name: str

    async def generate(self, prompts: Sequence[str], params: SamplingParams, on_chunk: OnChunk | None = None) -> list[Generation]:
        """Generate for every prompt (batched by the engine); one Generation per prompt, in order.
        `on_chunk` hears each TokenChunk as it is made, called on the caller's event loop by the
        engine's own hand-off (no queue between: a streamed answer's tokens cross one queue on
        their way to the client, its response's); when it returns True, the call ends there
        ("stop"), its Generations holding what was generated until the engine saw it."""
        ...

    def stream(self, prompts: Sequence[str], params: SamplingParams) -> AsyncGenerator[Streamed, None]:
        """Yield TokenChunks as tokens are produced and one Generation per prompt when it
        finishes; closing it aborts what is unfinished. The pull form of `generate`'s `on_chunk`."""
        ...

    def count_tokens(self, text: str) -> int: ...

    def decode(self, token_ids: Sequence[int]) -> str: ...

    def format_prompt(self, user_text: str, *, system: str = "") -> str:
        """`system` and the user turn in the model's chat template; for a base model without
        one, the system text above the user text."""
        ...

    async def close(self) -> None: ...


@runtime_checkable
class Prefiller(Engine, Protocol):
    """An engine that can also prefill a prompt alone, an optional capability (both engines here
    have it): what speculative prefill needs, checked once when a pipeline is built."""

    async def prefill(self, prompts: Sequence[str]) -> list[Generation]:
        """Prefill each prompt and keep its KV for a later prompt that begins the same way (the
        prefix cache; SGLang's radix cache), generating nothing: one Generation of no tokens per
        prompt, whose `cached_tokens` the engine held already."""
        ...


@dataclass(frozen=True)
class DocumentChunks:
    """A formatted prompt cut around its documents: `head` (the template's start, the fixed
    instruction and the heading), one chunk per document (its entry and the blank line after
    it), and `tail` (what follows: instructions, question, cue, the template's end). The parts
    join back into the prompt. What an engine with per-document KV reuses (TurboRAG): each
    chunk's KV is computed once, as if it followed `head` directly, whatever comes between."""

    head: str
    chunks: tuple[str, ...]
    tail: str


# A prompt (as `Engine.format_prompt` wrote it) cut around its documents, or None without any:
# the prompts' writer knows their layout (`pipelines.prompts.document_chunks`), the engine does not.
DocumentSplitter = Callable[[str], DocumentChunks | None]
