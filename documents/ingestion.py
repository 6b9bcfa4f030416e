"""A corpus into a new datastore, written as any documents are: a sample of its documents first,
embedded to train the first centroids (the seed, a datastore that answers at once), then the rest
a block at a time through `documents.DocumentWriter` (each block durable and searchable once
written), then the centroids trained again on all of them (`LiveDatastore.retrain`).

`telerag datastore build` and any command that opens a datastore whose ingestion has not ended
run it to its end first; `telerag serve` writes the seed, answers from it, and writes the rest
while it serves (`Ingestion.start`). How far it is, is kept in `ingestion.json` beside the
datastore's files, so that one stopped part-way goes on from its last block when next opened.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from enum import StrEnum
from pathlib import Path

import numpy as np

from telerag.documents.writer import DocumentText, DocumentWriter, Embed
from telerag.retrieval.builder import Encoder, build_datastore
from telerag.retrieval.codecs import Codec
from telerag.retrieval.corpus import WIKIPEDIA_SOURCE, Article, PassageShape, read_jsonl, read_wikipedia
from telerag.retrieval.documents import WriteOutcome
from telerag.retrieval.errors import DatastoreBusy, DatastoreCorruptError, DatastoreError
from telerag.retrieval.generations import INGESTION
from telerag.retrieval.live import LiveDatastore
from telerag.utils.progress import ProgressBar
from telerag.utils.storage import write_by_rename

log = logging.getLogger(__name__)

SAMPLE_PASSAGES = 512  # the seed's passages (whole documents drawn at random): 13 lists' training, 10 s to embed on 2 cores
BLOCK_PASSAGES = 256  # a block's passages (one document at least): one write, one sync, then the record moves past it


class IngestionState(StrEnum):
    INGESTING = "ingesting"  # writing the corpus's documents, a block at a time
    RETRAINING = "retraining"  # every document written: new centroids trained on all of them
    DONE = "done"
    FAILED = "failed"  # a block or the retrain failed; the next start goes on from the last block written


@dataclass(frozen=True)
class IngestionRecord:
    """`ingestion.json`: which corpus is being written into the datastore, and how far."""

    source: str  # the corpus: `corpus.WIKIPEDIA_SOURCE`, or the path of a JSONL file
    documents: int  # the corpus's
    written: int  # how many of them, in the corpus's order, are written (the seed's among them or not)
    nlist: int | None = None  # the lists of the retrain at the end (None: the build's rule)
    done: bool = False  # written and retrained

    @classmethod
    def read(cls, root: Path) -> IngestionRecord | None:
        """The datastore's record (None: it was not built by an ingestion, or before there were any)."""
        path = root / INGESTION
        if not path.is_file():
            return None
        try:
            return cls(**json.loads(path.read_text(encoding="utf-8")))
        except (ValueError, TypeError) as exc:
            raise DatastoreCorruptError(f"{path} is unreadable ({exc})") from None

    def write(self, root: Path) -> None:
        write_by_rename(root / INGESTION, self.encode())

    def encode(self) -> bytes:
        return json.dumps(asdict(self)).encode("utf-8")


@dataclass(frozen=True)
class IngestionProgress:
    """How far an ingestion is, as `/ready`, `GET /v1/datastore` and the metrics report it."""

    source: str
    state: IngestionState
    documents: int  # of the corpus, those the datastore holds
    total_documents: int
    error: str | None = None


def corpus_documents(articles: Iterable[Article]) -> list[DocumentText]:
    """A corpus's articles as documents (their ids, titles and texts)."""
    return [DocumentText(article.id, article.text, article.title) for article in articles]


def read_corpus(source: str) -> list[DocumentText] | None:
    """The documents of the corpus a record names: the built-in Wikipedia, or a JSONL file that is
    still there (None: it is not)."""
    if source == WIKIPEDIA_SOURCE:
        return corpus_documents(read_wikipedia())
    path = Path(source)
    return corpus_documents(read_jsonl(path)) if path.is_file() else None


def write_seed(
    out_dir: Path,
    documents: Sequence[DocumentText],
    encode: Encoder,
    *,
    embedder: str,
    source: str,
    shape: PassageShape | None = None,
    codec: Codec = Codec.FP32,
    nlist: int | None = None,
    sample_passages: int = SAMPLE_PASSAGES,
    batch_size: int = 1024,
    overwrite: bool = False,
    progress: bool = True,
    seed: int = 1234,
) -> Path:
    """A datastore at `out_dir` of whole documents drawn at random from `documents` until they
    hold `sample_passages` passages (all of them, for a smaller corpus: then it is complete, with
    `nlist` lists); else with the build's rule of lists for the sample, and the record of an
    ingestion that has written none of the rest yet (written with the datastore's files, so a
    seed is never taken for a whole corpus). `out_dir` is checked before anything is embedded
    (`build_datastore`)."""
    shape = shape or PassageShape()
    cuts = [list(shape.split([_article(document)])) for document in documents]
    chosen = _sample([len(cut) for cut in cuts], sample_passages, seed)
    complete = len(chosen) == len(documents)
    record = None if complete else IngestionRecord(source, len(documents), 0, nlist)
    if not complete:
        log.info(
            "%s: the first %d of %d documents, drawn at random, to train the first centroids on; the rest follow",
            out_dir,
            len(chosen),
            len(documents),
        )
    return build_datastore(
        [passage for i in chosen for passage in cuts[i]],
        encode,
        embedder=embedder,
        out_dir=out_dir,
        nlist=nlist if complete else None,
        codec=codec,
        batch_size=batch_size,
        source=source,
        shape=shape,
        content_hashes={documents[i].doc_id: documents[i].content_hash for i in chosen},
        extra_files={} if record is None else {INGESTION: record.encode()},
        overwrite=overwrite,
        progress=progress,
        seed=seed,
    )


def _sample(passages: Sequence[int], target: int, seed: int) -> list[int]:
    """Documents (by index, in their order) drawn at random until they hold `target` passages."""
    order = np.random.default_rng(seed).permutation(len(passages))
    held = np.cumsum(np.asarray(passages, dtype=np.int64)[order])
    taken = int(np.searchsorted(held, target)) + 1  # the first prefix holding `target`, or all
    return sorted(order[:taken].tolist())


def _article(document: DocumentText) -> Article:
    return Article(id=document.doc_id, title=document.shown_title, text=document.text)


class Ingestion:
    """The documents of a corpus written into a live datastore after its seed, a block at a time
    from where its record says, then its centroids trained again (`retrain`, with the record's
    nlist): in the calling thread (`run`), or in one of its own (`start`) while the datastore serves."""

    def __init__(
        self,
        writer: DocumentWriter,
        documents: Sequence[DocumentText],
        record: IngestionRecord,
        *,
        retrain: Callable[[int | None], object],
        block_passages: int = BLOCK_PASSAGES,
        progress: bool = False,
    ) -> None:
        if record.documents != len(documents):
            raise DatastoreError(
                f"{writer.live.where}: its ingestion record counts {record.documents} documents in {record.source}, "
                f"not the {len(documents)} given"
            )
        assert writer.live.root is not None  # a record was read from it
        self.root = writer.live.root
        self.writer, self.documents, self.record = writer, documents, record
        self.retrain, self.block_passages, self.show_progress = retrain, block_passages, progress
        self._state = IngestionState.DONE if record.done else IngestionState.INGESTING
        self._error: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # of the corpus, the documents held: those before the record's mark, and those after it held already (the
        # seed's, drawn from all of it); one number, so that a reader in another thread sees the two as one
        self._held = record.documents if record.done else record.written + _held_among(writer.live, documents[record.written :])

    @property
    def progress(self) -> IngestionProgress:
        record = self.record
        return IngestionProgress(record.source, self._state, self._held, record.documents, self._error)

    def start(self) -> None:
        """`run` in a thread of its own (a failure is logged and reported in `progress`)."""
        if self._thread is None and not self.record.done:
            self._thread = threading.Thread(target=self._run_logged, name="telerag-ingestion", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """End the thread once the block in hand is written (the next start goes on from there)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def run(self) -> None:
        """Write the documents not written yet, a block at a time, then retrain and mark it done."""
        try:
            self._write_rest()
            if self._stop.is_set():
                return
            self._state = IngestionState.RETRAINING
            log.info("%s: all of %s written; training its centroids again on all of it", self.root, self.record.source)
            self.retrain(self.record.nlist)
            self._advance(replace(self.record, done=True))
            self._state = IngestionState.DONE
        except BaseException as exc:
            self._state, self._error = IngestionState.FAILED, str(exc) or type(exc).__name__
            raise

    def _write_rest(self) -> None:
        record = self.record
        remaining = record.documents - record.written
        if remaining:
            log.info(
                "%s: writing documents %d-%d of %s (those the datastore holds already are skipped)",
                self.root,
                record.written + 1,
                record.documents,
                record.source,
            )
        shape = self.writer.live.shape
        with ProgressBar[None](total=remaining, desc="ingest documents", unit="doc", disable=not self.show_progress) as bar:
            at = record.written
            while at < record.documents and not self._stop.is_set():
                block: list[DocumentText] = []
                passages = 0
                while at + len(block) < record.documents and (not block or passages < self.block_passages):
                    document = self.documents[at + len(block)]
                    block.append(document)
                    passages += sum(1 for _ in shape.split([_article(document)]))
                results = self.writer.write_now(block, if_absent=True)  # a document a client wrote meanwhile stays theirs
                at += len(block)
                self._advance(replace(self.record, written=at))
                self._held += sum(result.outcome is WriteOutcome.CREATED for result in results)
                bar.update(len(block))

    def _advance(self, record: IngestionRecord) -> None:
        record.write(self.root)
        self.record = record

    def _run_logged(self) -> None:
        try:
            self.run()
        except Exception:  # the server serves what was written; its next start goes on
            log.exception("%s: the ingestion of %s failed; what was written serves", self.root, self.record.source)


def _held_among(live: LiveDatastore, documents: Sequence[DocumentText]) -> int:
    """How many of `documents` the datastore holds (by id), read a page of its catalog at a time."""
    wanted = {document.doc_id for document in documents}
    held, after = 0, None
    while page := live.documents(after=after, limit=1000):
        held += sum(entry.doc_id in wanted for entry in page)
        after = page[-1].doc_id
    return held


def ingest(
    path: Path,
    documents: Sequence[DocumentText],
    encode: Embed,
    record: IngestionRecord,
    *,
    block_passages: int = BLOCK_PASSAGES,
    progress: bool = True,
) -> bool:
    """The rest of `documents` written into the datastore at `path` here and now, a block of
    `block_passages` passages at a time, then retrained; False, saying so, while another process
    holds it (a server, which writes them itself) or where it cannot be written."""
    try:
        live = LiveDatastore.open(path, verify_checksums=False, writable=True)
    except DatastoreBusy:
        log.info("%s: another process holds it and writes the rest of %s into it; what is written serves", path, record.source)
        return False
    except OSError as exc:  # a read-only directory: what is written serves
        log.warning("%s cannot be written (%s): the rest of %s cannot be ingested here", path, exc, record.source)
        return False
    try:
        ingestion = Ingestion(
            DocumentWriter(live, encode),
            documents,
            record,
            retrain=lambda nlist: live.retrain(nlist=nlist, progress=progress),
            block_passages=block_passages,
            progress=progress,
        )
        ingestion.run()
    finally:
        live.close()
        live.datastore.close()
    return True


def ingestion_pending(path: Path) -> bool:
    """Whether the datastore at `path` has an ingestion that has not ended."""
    record = IngestionRecord.read(path)
    return record is not None and not record.done


def unfinished_ingestion(live: LiveDatastore) -> IngestionProgress | None:
    """How far the ingestion of `live`'s datastore is, while its corpus is not all written (None: it
    is, or none was begun), for what searches it read-only as another process writes the rest, as
    `telerag ask` may: the documents it holds (a client's among them, at most the corpus's) of the
    corpus's."""
    record = None if live.root is None else IngestionRecord.read(live.root)
    if record is None or record.written >= record.documents:
        return None
    held = min(live.stats().documents, record.documents)
    return IngestionProgress(record.source, IngestionState.INGESTING, held, record.documents)


def finish_ingestion(path: Path, encode: Embed, *, progress: bool = True) -> None:
    """Go on with the ingestion of the datastore at `path` to its end, if it has not ended (for
    whatever opens it to search it whole: `telerag ask`, the benchmarks)."""
    record = IngestionRecord.read(path)
    if record is None or record.done:
        return
    documents = _corpus_of(record, path)
    if documents is not None:
        ingest(path, documents, encode, record, progress=progress)


def resumed_ingestion(writer: DocumentWriter, *, retrain: Callable[[int | None], object]) -> Ingestion | None:
    """The ingestion a server goes on with in the background: of its writable datastore, whose
    record has not ended, from a corpus still there (None: nothing to go on with)."""
    live: LiveDatastore = writer.live
    if live.root is None or not live.writable:
        return None
    record = IngestionRecord.read(live.root)
    if record is None or record.done:
        return None
    documents = _corpus_of(record, live.root)
    return None if documents is None else Ingestion(writer, documents, record, retrain=retrain)


def _corpus_of(record: IngestionRecord, root: Path) -> list[DocumentText] | None:
    """The corpus an ingestion goes on with: its record's, as long as it holds as many documents
    as when it began (None, saying why, if it is gone or changed: what was written serves)."""
    documents = read_corpus(record.source)
    if documents is None or len(documents) != record.documents:
        what = "is gone" if documents is None else f"holds {len(documents)} documents, not {record.documents} as it did"
        log.warning("%s: its ingestion of %s cannot go on: the corpus %s; what was written serves", root, record.source, what)
        return None
    return documents
