"""A vector store's passages: a live datastore of its own (`retrieval.live`), searched exactly.

An IVF cannot be trained on nothing, so a new store has no datastore: its first file's passages
build one (`build_datastore`, `default_nlist(n)` lists: one for a store under 78 passages). Later
files are writes into it (`DocumentWriter`, the document's id the file's), so detaching a file
deletes its passages. Once a store holds 4x the passages its lists were trained on, it is
retrained to `default_nlist(n)` lists (`Rebuilds.run`), so its lists follow its size; between
retrains, a compaction begins by itself as the server's own datastore's do.

Each store's engine is on the server's device, its cluster cache on the server's cluster cache
buffer: a cached list is a (store, list) pair, weighed against the server's datastore's lists and
every other store's on one clock, and a request's lookahead over stores copies their lists as it
does the server's (`StoresRetriever.prefetch`). Passages are embedded by the server's embedder
below its queries' priority (`StoreResources`), and a store's query at the queries' priority.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from telerag.documents.rebuilds import RebuildKind, Rebuilds
from telerag.documents.writer import DocumentText, DocumentWriter
from telerag.file_search.errors import VectorStoreNotFound
from telerag.file_search.vector_store_records import StaticChunking, StoreFile
from telerag.pipelines.text_encoder import TextEncoder
from telerag.pipelines.types import SearchOutcome, SearchRequest
from telerag.retrieval.builder import build_datastore, default_nlist
from telerag.retrieval.corpus import Article, Passage, PassageShape
from telerag.retrieval.datastore import MANIFEST, Datastore
from telerag.retrieval.prefetch import PrefetchHandle
from telerag.retrieval.snapshot import Snapshot

if TYPE_CHECKING:  # the retriever brings torch: the server's app is made, and listens, before it loads
    from telerag.pipelines.embedding_priority import EmbeddingPriority
    from telerag.pipelines.retriever import DirectRetriever
    from telerag.retrieval.cache import CacheBuffer

GROWTH_TO_RETRAIN = 4  # a store is retrained once it holds this many times the passages its lists were trained on
COUNT_WORDS = 32  # words per piece when the embedder's tokens per word are counted: far below any embedder's length


@dataclass(frozen=True)
class StoreResources:
    """What the server lends its vector stores: its embedder, `embed_passages` below its
    queries' priority (a server's: `DirectRetriever.embed_passages`), a store's query at it
    (`priority`), `shape` the server's passage rule (`auto` chunking); the stores' engines on
    `device` with their lists in `cache` (the server's cluster cache buffer), and what one
    request's lookahead may copy in a given overlap (`budget_bytes`, the server's rule)."""

    embedder: TextEncoder
    shape: PassageShape
    embed_passages: Callable[[Sequence[str]], np.ndarray]
    priority: EmbeddingPriority
    device: str = "cpu"
    cache: CacheBuffer | None = None  # None: the stores' engines have no cluster cache
    budget_bytes: Callable[[float | None], int] = lambda overlap_ms: 0
    on_stream: Callable[[], AbstractContextManager[object]] = contextlib.nullcontext  # the retrieval stream (CUDA)

    @classmethod
    def of(cls, retriever: DirectRetriever) -> StoreResources:
        engine = retriever.retrieval_engine
        return cls(
            retriever.embedder,
            retriever.live.shape,
            retriever.embed_passages,
            retriever.priority,
            str(engine.device),
            engine.cache.shared,
            retriever.budget_bytes,
            engine.on_stream,
        )

    def passage_shape(self, chunking: StaticChunking | None, text: str) -> PassageShape | None:
        """How `text` is cut: None for `auto` (the server's rule, the store's own); `static`'s
        tokens mapped onto the passage rule's words by the embedder's tokens per word in `text`
        (a passage of about `max_tokens` tokens; the rule joins a short tail to the passage before)."""
        if chunking is None:
            return None
        per_word = tokens_per_word(self.embedder, text.split())
        words = max(1, int(chunking.max_tokens / per_word))
        overlap = min(int(chunking.overlap_tokens / per_word), words - 1)
        return PassageShape(words, overlap, self.shape.title)


def tokens_per_word(embedder: TextEncoder, words: list[str]) -> float:
    """The embedder's tokens per word over `words` (its special tokens left out), counted in
    pieces short enough that the embedder's length never cuts one."""
    pieces = [" ".join(words[i : i + COUNT_WORDS]) for i in range(0, len(words), COUNT_WORDS)]
    special = embedder.count_tokens([""])
    tokens = embedder.count_tokens(pieces) - special * len(pieces)
    return max(tokens, 1) / max(len(words), 1)


class StoreIndex:
    """One store's passages: its datastore at `root` (none there until its first file), the
    writer, rebuilds and retriever over it. Writes and deletes are one at a time; searches read
    snapshots beside them, and `close` waits for those under way."""

    def __init__(self, root: Path, resources: StoreResources, *, trained_on: int, compact_share: float | None) -> None:
        self.root, self.resources, self.compact_share = root, resources, compact_share
        self.trained_on = trained_on
        self._changing = threading.Lock()  # writes, deletes, close
        self._readers = threading.Condition()  # searches under way, and whether it is closed
        self._reading, self._closed = 0, False
        self._retriever: DirectRetriever | None = None
        self._writer: DocumentWriter | None = None
        self._rebuilds: Rebuilds | None = None
        if (root / MANIFEST).is_file():
            self._open()

    def _open(self) -> None:
        from telerag.pipelines.datastores import open_retriever  # torch, by now loaded by the server

        embedder = self.resources.embedder
        datastore = Datastore.load(self.root, embedder=embedder.name, dim=embedder.dim, progress=False)  # checked, no bar
        resources = self.resources
        retriever = open_retriever(datastore, embedder, device=resources.device, cache_buffer=resources.cache, writable=True)
        self._rebuilds = Rebuilds(retriever.live, compact_share=self.compact_share)
        self._writer = DocumentWriter(retriever.live, self.resources.embed_passages, on_written=self._rebuilds.after_writes)
        self._retriever = retriever

    def write(
        self, file_id: str, title: str, text: str, chunking: StaticChunking | None, wanted: Callable[[], bool]
    ) -> int | None:
        """Write a file's passages (replacing those of an earlier attachment), unless `wanted()`,
        asked once no other change runs, says it is no longer wanted (None). Returns the bytes the
        store holds for it: its passages' text and their float32 vectors."""
        with self._changing:
            if self._closed or not wanted():
                return None
            shape = self.resources.passage_shape(chunking, text)
            document = DocumentText(file_id, text, title, shape=shape)
            if self._writer is None:
                self._build(document, shape or self.resources.shape)
            else:
                self._writer.write_now([document])
                self._retrain_if_grown()
            return self._usage(file_id)

    def _build(self, document: DocumentText, shape: PassageShape) -> None:
        """The store's datastore, from its first file's passages (the server's rule recorded as
        its own, the one `auto` files are cut by)."""
        passages = list(shape.split([Article(document.doc_id, document.shown_title, document.text)]))
        build_datastore(
            passages,
            self.resources.embed_passages,
            embedder=self.resources.embedder.name,
            out_dir=self.root,
            nlist=default_nlist(len(passages)),
            shape=self.resources.shape,
            content_hashes={document.doc_id: document.content_hash},
            progress=False,
        )
        self._open()
        self.trained_on = len(passages)

    def _retrain_if_grown(self) -> None:
        assert self._retriever is not None and self._rebuilds is not None
        living = self._retriever.live.snapshot().passages
        if living >= GROWTH_TO_RETRAIN * max(self.trained_on, 1):
            self._rebuilds.run(RebuildKind.RETRAIN, nlist=default_nlist(living))
            self.trained_on = living

    def _usage(self, file_id: str) -> int:
        passages = self._passages(file_id)
        return sum(len(p.text.encode("utf-8")) for p in passages) + len(passages) * self.resources.embedder.dim * 4

    def _passages(self, file_id: str) -> list[Passage]:
        if self._retriever is None:
            return []
        live = self._retriever.live
        entry = live.document(file_id)
        return [] if entry is None else live.snapshot().passages_of(list(entry.passage_ids))

    def delete(self, file_id: str) -> None:
        """The file's passages gone from every search that starts after this returns."""
        with self._changing:
            if self._writer is not None and not self._closed:
                self._writer.write_now([file_id])

    @contextlib.contextmanager
    def _read(self) -> Iterator[DirectRetriever | None]:
        with self._readers:
            if self._closed:
                raise VectorStoreNotFound("the vector store was deleted")
            self._reading += 1
        try:
            yield self._retriever
        finally:
            with self._readers:
                self._reading -= 1
                self._readers.notify_all()

    def passages(self, file_id: str) -> list[str]:
        """The file's passages, in order (none before it is processed)."""
        with self._read():
            return [p.text for p in self._passages(file_id)]

    def view(self, only: Collection[str] | None = None) -> Snapshot | None:
        """The store as a search reads it now (None: empty, no datastore yet); with `only`, those
        files' passages alone, read as one version with the snapshot (a filter's)."""
        with self._read() as retriever:
            if retriever is None:
                return None
            if only is None:
                return retriever.live.snapshot()
            snapshot, entries = retriever.live.snapshot_of(only)
            return snapshot.restricted_to([i for entry in entries.values() for i in entry.passage_ids])

    def prefetch(self, queries: np.ndarray, budget_bytes: int, view: Snapshot | None) -> PrefetchHandle | None:
        """Start copying the lists of `view`'s generation nearest `queries` (q_in, (n, dim)) into
        the cluster cache, within `budget_bytes` (None: nothing to copy)."""
        with self._read() as retriever:
            if retriever is None or view is None or budget_bytes <= 0:
                return None
            return retriever.retrieval_engine_for(view.datastore).prefetch(queries, budget_bytes)

    def search_embedded(self, requests: list[SearchRequest], vectors: np.ndarray, embed_ms: float) -> list[SearchOutcome]:
        """The searches of `requests` (each over its view, the snapshot its options name) given
        their queries' vectors: the store's retriever's batched search (`DirectRetriever.search_embedded`),
        each view's dense half exactly as faiss's IndexIVF over its passages would answer at the
        engine's default nprobe (a filter's view as faiss's with an ID selector of the files'
        passages); a request's ticket holds this store's part of its lookahead."""
        with self._read() as retriever:
            if retriever is None:
                return [SearchOutcome([[] for _ in request.queries]) for request in requests]
            return retriever.search_embedded(requests, vectors, embed_ms)

    def close(self) -> None:
        """Once the change and the searches under way end: the datastore's files and lock let go."""
        with self._changing, self._readers:
            self._closed = True
            self._readers.wait_for(lambda: self._reading == 0)
            if self._rebuilds is not None:
                self._rebuilds.join()
            if self._retriever is not None:
                self._retriever.close()


@dataclass(frozen=True)
class StoreView:
    """One store as a request reads it: its snapshot (taken when the request began; a filter's
    holds the matching files' passages alone) and its files as they were then."""

    store_id: str
    index: StoreIndex
    snapshot: Snapshot | None  # None: the store had no passages
    files: Mapping[str, StoreFile]

    def prefetch(self, queries: np.ndarray, budget_bytes: int) -> PrefetchHandle | None:
        """The lookahead of the snapshot's lists for `queries` (q_in, (n, dim))."""
        return self.index.prefetch(queries, budget_bytes, self.snapshot)
