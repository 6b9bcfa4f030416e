"""Typed errors of the pipelines package; the server maps them to HTTP status codes in one place
(by class), and reports each one's `code` slug to the client. The LLM engine's are the engines'
own (`engines.errors`)."""

from __future__ import annotations

from telerag.engines.errors import ModelNotFound


class PipelineError(Exception):
    """Base class of every error raised by `pipelines`."""

    code = "pipeline_error"


class EmbedderError(PipelineError):
    """The embedder could not be loaded or failed."""

    code = "embedder_error"


class EmbedderNotFound(ModelNotFound, EmbedderError):
    """No embedder model at the configured path: the models' load error (`engines.errors`) and
    the embedder's, so code that catches `ModelNotFound` or `EmbedderError` sees it."""


class UnknownPipeline(PipelineError):
    """No pipeline of that name."""

    code = "unknown_pipeline"


class EngineLacksCapability(PipelineError):
    """A request asks for what the engine cannot do (speculative prefill on an engine that cannot
    prefill a prompt alone): refused rather than run without it."""

    code = "unsupported_by_engine"


class UndeclaredStage(PipelineError):
    """A pipeline traced a stage it does not declare in its `stages`: a bug in the pipeline, not
    the caller's mistake."""

    code = "undeclared_stage"
