"""Typed errors of the file_search package; the server maps them to HTTP status codes in one
place (by class), and reports each one's `code` slug to the client."""

from __future__ import annotations


class FileSearchError(Exception):
    """Base class of every error raised by `file_search`."""

    code = "file_search_error"


class FileNotFound(FileSearchError):
    """No uploaded file of that id (or none its key may see)."""

    code = "file_not_found"


class FilesTooLarge(FileSearchError):
    """An upload that would take its key's files over `files.max_bytes_per_key`."""

    code = "files_too_large"


class VectorStoreNotFound(FileSearchError):
    """No vector store of that id (or none its key may see)."""

    code = "vector_store_not_found"


class VectorStoreFileNotFound(FileSearchError):
    """No file of that id attached to the vector store."""

    code = "file_not_found"


class FileBatchNotFound(FileSearchError):
    """No file batch of that id in the vector store."""

    code = "file_batch_not_found"


class VectorStoresTooLarge(FileSearchError):
    """A key's vector stores would be more, or hold more bytes, than `vector_stores.max_stores_per_key`
    or `max_bytes_per_key` allow."""

    code = "vector_stores_too_large"


class VectorStoresUnavailable(FileSearchError):
    """This deployment embeds nothing in process, so it serves no vector stores (a Ray cluster's replicas)."""

    code = "vector_stores_unavailable"
