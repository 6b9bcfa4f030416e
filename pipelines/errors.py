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


class UndeclaredStage(PipelineError):
    """A pipeline traced a stage it does not declare in its `stages`: a bug in the pipeline, not
    the caller's mistake."""

    code = "undeclared_stage"


class InvalidDocument(PipelineError):
    """A document a client gave cannot be written: no id, no text (`field` names what)."""

    code = "invalid_document"

    def __init__(self, message: str, *, field: str) -> None:
        super().__init__(message)
        self.field = field


class WritesBusy(PipelineError):
    """The queue of writes to the datastore is full; the caller may retry later."""

    code = "writes_busy"


class UnsupportedFile(PipelineError):
    """A file of a type the server does not convert (it names the type)."""

    code = "unsupported_file"


class FileUnreadable(PipelineError):
    """A file of a supported type that cannot be read as one (damaged, not UTF-8, no text layer)."""

    code = "unreadable_file"


class RebuildRunning(PipelineError):
    """A compaction or retrain was asked for while one runs."""

    code = "rebuild_running"


class DocumentsTooLarge(PipelineError):
    """A write whose documents are cut into more passages than one request may write."""

    code = "documents_too_large"


class FileNotFound(PipelineError):
    """No uploaded file of that id (or none its key may see)."""

    code = "file_not_found"


class FilesTooLarge(PipelineError):
    """An upload that would take its key's files over `files.max_bytes_per_key`."""

    code = "files_too_large"


class VectorStoreNotFound(PipelineError):
    """No vector store of that id (or none its key may see)."""

    code = "vector_store_not_found"


class VectorStoreFileNotFound(PipelineError):
    """No file of that id attached to the vector store."""

    code = "file_not_found"


class FileBatchNotFound(PipelineError):
    """No file batch of that id in the vector store."""

    code = "file_batch_not_found"


class VectorStoresTooLarge(PipelineError):
    """A key's vector stores would be more, or hold more bytes, than `vector_stores.max_stores_per_key`
    or `max_bytes_per_key` allow."""

    code = "vector_stores_too_large"


class VectorStoresUnavailable(PipelineError):
    """This deployment embeds nothing in process, so it serves no vector stores (a Ray cluster's replicas)."""

    code = "vector_stores_unavailable"
