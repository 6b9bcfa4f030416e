"""Typed errors of the documents package; the server maps them to HTTP status codes in one place
(by class), and reports each one's `code` slug to the client."""

from __future__ import annotations


class DocumentError(Exception):
    """Base class of every error raised by `documents`."""

    code = "document_error"


class InvalidDocument(DocumentError):
    """A document a client gave cannot be written: no id, no text (`field` names what)."""

    code = "invalid_document"

    def __init__(self, message: str, *, field: str) -> None:
        super().__init__(message)
        self.field = field


class WritesBusy(DocumentError):
    """The queue of writes to the datastore is full; the caller may retry later."""

    code = "writes_busy"


class UnsupportedFile(DocumentError):
    """A file of a type the server does not convert (it names the type)."""

    code = "unsupported_file"


class FileUnreadable(DocumentError):
    """A file of a supported type that cannot be read as one (damaged, not UTF-8, no text layer)."""

    code = "unreadable_file"


class RebuildRunning(DocumentError):
    """A compaction or retrain was asked for while one runs."""

    code = "rebuild_running"


class DocumentsTooLarge(DocumentError):
    """A write whose documents are cut into more passages than one request may write."""

    code = "documents_too_large"
