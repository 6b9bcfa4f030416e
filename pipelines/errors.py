"""Typed errors of the pipelines package; the server maps them to HTTP status codes in one place."""

from __future__ import annotations


class PipelineError(Exception):
    """Base class of every error raised by `pipelines`."""

    code = "pipeline_error"


class EngineError(PipelineError):
    """The LLM engine failed while generating."""

    code = "engine_error"


class EngineUnavailable(PipelineError):
    """The engine is not installed or could not load its model."""

    code = "engine_unavailable"


class EmbedderError(PipelineError):
    """The embedder could not be loaded or failed."""

    code = "embedder_error"


class UnknownPipeline(PipelineError):
    """No pipeline of that name."""

    code = "unknown_pipeline"
