"""Typed errors of the engines package; the server maps them to HTTP status codes in one place
(by class), and reports each one's `code` slug to the client."""

from __future__ import annotations


class EngineError(Exception):
    """Base class of every error raised by `engines`; raised itself, the LLM engine failed while
    generating (a bug or a broken model, not the caller's fault)."""

    code = "engine_error"


class EngineUnavailable(EngineError):
    """The engine is not installed or could not load its model: nothing can be generated."""

    code = "engine_unavailable"


class EngineOverloaded(EngineError):
    """The engine's queue is full; the caller may retry later."""

    code = "engine_overloaded"


class GenerationAborted(EngineError):
    """The engine stopped a generation before it finished (it was closed, or aborted it itself)."""

    code = "generation_aborted"


class ModelNotFound(EngineUnavailable):
    """No model at the configured path: a model's load error, the engine's (and, as
    `pipelines.errors.EmbedderNotFound`, the embedder's)."""

    code = "model_not_found"
