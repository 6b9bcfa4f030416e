"""Typed errors of the retrieval package; the server maps them to HTTP status codes in one place."""

from __future__ import annotations

from pathlib import Path


class RetrievalError(Exception):
    """Base class of every error raised by `retrieval`."""

    code = "retrieval_error"


class CorpusError(RetrievalError):
    """The input corpus is unusable; names the file and, where there is one, the line."""

    code = "bad_corpus"

    def __init__(self, message: str, *, path: Path | str | None = None, line: int | None = None) -> None:
        where = "" if path is None else f"{path}" + ("" if line is None else f":{line}") + ": "
        super().__init__(where + message)
        self.path = path
        self.line = line


class DatastoreError(RetrievalError):
    """A datastore cannot be built or loaded."""

    code = "datastore_error"


class DatastoreMismatchError(DatastoreError):
    """The datastore was built for another embedder, dimension or codec than the one configured."""

    code = "datastore_mismatch"


class DatastoreCorruptError(DatastoreError):
    """A datastore file is missing, truncated or fails its checksum."""

    code = "datastore_corrupt"


class DatastoreBusy(DatastoreError):
    """Another process holds the datastore for writing (`retrieval.live`)."""

    code = "datastore_busy"


class DatastoreReadOnly(DatastoreError):
    """A write to a datastore that cannot take one: opened read-only (another process holds it,
    or its directory cannot be written), or holding vectors without passages."""

    code = "datastore_read_only"


class LayoutError(RetrievalError):
    """Vectors, codes or codec parameters not laid out as the datastore or codec needs: a caller's
    mistake (wrong shape, dtype or memory order), never a user's input."""

    code = "bad_layout"


class PassageNotFound(RetrievalError):
    """A vector id with no passage in the datastore (outside its rows)."""

    code = "passage_not_found"


class SearchError(RetrievalError):
    """A search request is invalid (bad nprobe, k, or query shape): the request's mistake."""

    code = "bad_search"


class InvalidCall(RetrievalError):
    """The retrieval engine's caller broke its contract (prefetch handles that do not match the
    queries, a cache resized while clusters are pinned): a bug in the code that calls it, never
    a client's request."""

    code = "invalid_call"


class DeviceUnavailable(RetrievalError):
    """The configured device cannot be used: torch does not know it, or it is CUDA and there is none."""

    code = "device_unavailable"


class DeviceMemoryError(RetrievalError):
    """The device cannot hold what was asked of it: a cluster cache larger than the memory that
    is free on it beside what else it holds (an LLM)."""

    code = "device_memory"


class TierUnavailable(RetrievalError):
    """A shard of the retrieval tier (`server.ray_serve.tier`) did not answer after every attempt: the
    search fails whole, never with a partial top-k."""

    code = "retrieval_tier_unavailable"


class GenerationGone(RetrievalError):
    """A retrieval shard's replica does not hold the generation a search named: it started after
    the writer switched away from it, whose files are gone. Another replica of the shard may hold
    it (the call is asked again there); if none does, the search fails as `TierUnavailable`."""

    code = "retrieval_generation_gone"


class TierBusy(RetrievalError):
    """Every replica of a shard of the retrieval tier has its queue full (Ray Serve's
    back-pressure): come back later."""

    code = "retrieval_tier_busy"
