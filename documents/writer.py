"""Documents into a live datastore: cut into passages by the datastore's own rule, embedded below
queries' priority, and written in batches, one sync each (`retrieval.live`).

The server's writes go through one queue to one writer thread, so they are applied in the order
they arrive and a stream of them is grouped: what queued while a batch was written is written
together next. A document whose content hash is the datastore's already is not embedded at all.
A full queue refuses at once (`WritesBusy`): writes never pile up behind a slow embedder.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import queue
import re
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from telerag.documents.conversion import convert, file_format
from telerag.documents.errors import DocumentsTooLarge, InvalidDocument, WritesBusy
from telerag.retrieval.corpus import Article, Passage, PassageShape
from telerag.retrieval.documents import DocumentDelete, DocumentEntry, DocumentUpsert, Write, WriteResult
from telerag.retrieval.live import LiveDatastore, LiveStats

BATCH_PASSAGES = 512  # a batch takes queued writes while their passages are at most this many (at least one write)


# A document's id and text each need a character that is not blank: not Python's whitespace (what cuts a text
# into words, `str.split`: U+001C-U+001F too), nor U+FEFF. As a pattern a JSON Schema validator reads the same.
NON_BLANK = r"[^\t\n\x0b\f\r\x1c-\x1f \u0085\u00a0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000\ufeff]"


@dataclass(frozen=True)
class DocumentText:
    """A document as a client gives it: its id, its text, a title (default: its id), metadata;
    `shape`: how it is cut into passages where not by the datastore's own rule (a vector store
    file's `static` chunking)."""

    doc_id: str
    text: str
    title: str = ""
    metadata: Mapping[str, Any] = field(default_factory=dict)
    shape: PassageShape | None = None

    def __post_init__(self) -> None:
        if not re.search(NON_BLANK, self.doc_id):
            raise InvalidDocument("a document's id must not be empty", field="id")
        if not re.search(NON_BLANK, self.text):
            raise InvalidDocument(f"document {self.doc_id!r} has no text", field="text")

    @property
    def shown_title(self) -> str:
        return self.title or self.doc_id

    @property
    def content_hash(self) -> str:
        """What makes two versions of a document the same: its title, text and metadata (and the
        rule it is cut by, where it has its own)."""
        cut = [] if self.shape is None else [[self.shape.words, self.shape.overlap]]
        canonical = json.dumps([self.shown_title, self.text, self.metadata, *cut], sort_keys=True, ensure_ascii=False)
        return "sha256:" + hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def document_of_file(doc_id: str, path: Path) -> DocumentText:
    """A file on disk as a document: converted by its type (`files`), titled by its own title
    (HTML's, Markdown's first heading, a PDF's) or else its name, as an upload is."""
    data = path.read_bytes()
    converted = convert(data, file_format(path.name, None, data))
    return DocumentText(doc_id, converted.text, converted.title or path.name)


Change = DocumentText | str  # a document to write, or the id of one to delete


@dataclass
class _Job:
    changes: list[Change]
    cuts: list[list[Passage]]  # each change's passages, cut once when it is asked for (a delete's: none)
    if_absent: bool = False  # its documents written only where none of their id is held (`DocumentUpsert.if_absent`)
    done: Future[list[WriteResult]] = field(default_factory=Future)

    @property
    def passages(self) -> int:
        return sum(len(cut) for cut in self.cuts)


Embed = Callable[[Sequence[str]], np.ndarray]  # passages' texts -> float32 (n, dim), as the datastore's embedder makes them


class DocumentWriter:
    """Writes documents into a live datastore: `upsert` and `delete` from the event loop (through
    the queue, `max_queued` jobs at most), or `write_now` in the calling thread."""

    def __init__(
        self, live: LiveDatastore, embed: Embed, *, max_queued: int = 64, on_written: Callable[[], None] = lambda: None
    ) -> None:
        """`embed`: the datastore's embedder (a server's: `DirectRetriever.embed_passages`, below
        its queries' priority); `on_written` hears each batch written (`rebuilds.Rebuilds.after_writes`)."""
        self.live = live
        self.embed = embed
        self.on_written = on_written
        self._queue: queue.Queue[_Job | None] = queue.Queue(maxsize=max_queued)
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()

    # -- reading ----------------------------------------------------------------------------------

    def document(self, doc_id: str) -> DocumentEntry | None:
        return self.live.document(doc_id)

    def documents(self, *, after: str | None = None, limit: int = 100) -> list[DocumentEntry]:
        return self.live.documents(after=after, limit=limit)

    def stats(self) -> LiveStats:
        return self.live.stats()

    # -- writing --------------------------------------------------------------------------------

    async def upsert(self, documents: Sequence[DocumentText], *, max_passages: int | None = None) -> list[WriteResult]:
        """Write `documents`, refused (`DocumentsTooLarge`) if they are cut into more than
        `max_passages` passages in all."""
        return await self._submit(self._job(documents, max_passages))

    async def delete(self, doc_ids: Sequence[str]) -> list[WriteResult]:
        return await self._submit(self._job(doc_ids))

    def write_now(self, changes: Sequence[Change], *, if_absent: bool = False) -> list[WriteResult]:
        """`changes` written in the calling thread (the command line over a datastore directory, an
        ingestion), beside the queue's writes (the datastore serialises them). `if_absent`: each
        document written only where the datastore holds none of its id, decided as it is written,
        so a client's write made meanwhile is never replaced (an ingestion's)."""
        results = self._write([self._job(changes, if_absent=if_absent)])[0]
        self.on_written()
        return results

    def _job(self, changes: Sequence[Change], max_passages: int | None = None, *, if_absent: bool = False) -> _Job:
        cuts = [[] if isinstance(change, str) else self._cut(change) for change in changes]
        job = _Job(list(changes), cuts, if_absent)
        if max_passages is not None and job.passages > max_passages:
            raise DocumentsTooLarge(
                f"the documents are cut into {job.passages} passages, over documents.max_passages ({max_passages}): "
                "write them in smaller batches"
            )
        return job

    async def _submit(self, job: _Job) -> list[WriteResult]:
        self._start()
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            raise WritesBusy(
                f"{self._queue.maxsize} writes are queued already: retry after a moment (documents.max_queued_writes)"
            ) from None
        return await asyncio.wrap_future(job.done)

    def _start(self) -> None:
        with self._start_lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name="telerag-writes", daemon=True)
                self._thread.start()

    def _work(self) -> None:
        while (job := self._queue.get()) is not None:
            batch = [job]
            while sum(j.passages for j in batch) < BATCH_PASSAGES:
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    self._queue.put(None)  # close() asked: stop once this batch is written
                    break
                batch.append(more)
            batch = [j for j in batch if j.done.set_running_or_notify_cancel()]
            try:
                results = self._write(batch)
            except Exception as exc:  # noqa: BLE001 - each caller of the batch hears it
                for j in batch:
                    j.done.set_exception(exc)
                continue
            for j, result in zip(batch, results, strict=True):
                j.done.set_result(result)
            self.on_written()

    def _write(self, batch: list[_Job]) -> list[list[WriteResult]]:
        """Embed what changed of `batch`'s documents and write it all: one sync."""
        shape = self.live.shape
        writes: list[Write] = []
        to_embed: list[tuple[int, list[str]]] = []  # (the write's index, what the embedder reads of its passages)
        hashes: dict[str, str | None] = {}  # each document's content hash after the batch's earlier writes
        for job in batch:
            for change, cut in zip(job.changes, job.cuts, strict=True):
                if isinstance(change, str):
                    writes.append(DocumentDelete(change))
                    hashes[change] = None
                    continue
                current = hashes[change.doc_id] if change.doc_id in hashes else self._hash_of(change.doc_id)
                held = job.if_absent and current is not None  # kept as it is: nothing to embed
                if not held:
                    hashes[change.doc_id] = change.content_hash
                passages = [] if held or current == change.content_hash else cut
                if passages:
                    to_embed.append((len(writes), [shape.embedding_text(p) for p in passages]))
                texts = tuple(p.text for p in passages)
                writes.append(
                    DocumentUpsert(
                        change.doc_id, change.shown_title, texts, None, change.content_hash, change.metadata, job.if_absent
                    )
                )
        if to_embed:
            vectors = self.embed([text for _, read in to_embed for text in read])
            start = 0
            for index, read in to_embed:
                upsert = writes[index]
                assert isinstance(upsert, DocumentUpsert)
                writes[index] = dataclasses.replace(upsert, vectors=vectors[start : start + len(read)])
                start += len(read)
        results = self.live.write(writes)
        out, at = [], 0
        for job in batch:
            out.append(results[at : at + len(job.changes)])
            at += len(job.changes)
        return out

    def _cut(self, document: DocumentText) -> list[Passage]:
        article = Article(id=document.doc_id, title=document.shown_title, text=document.text)
        return list((document.shape or self.live.shape).split([article]))

    def _hash_of(self, doc_id: str) -> str | None:
        entry = self.live.document(doc_id)
        return None if entry is None else entry.content_hash

    def close(self) -> None:
        """Stop the writer once the writes queued so far are written."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None
