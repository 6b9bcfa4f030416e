"""`telerag bench ingest`: a stream of document writes beside a stream of searches, on a copy of a
datastore (the user's is never written), in process, through the server's own retriever and writer.

The same searches run twice, side by side in one run: alone (half before the writes, half after),
and while a client writes documents one request at a time (upserts of the datastore's own
documents, revised; new documents; deletes). Each write's acknowledgment is timed, with the
embedding inside it; right after each acknowledgment a search for the written passage's own text
checks that it is visible (a delete: that it is gone): freshness is measured, not assumed. That
search is by the text's vector, embedded before the run: its embedding (of a whole document's
text) would otherwise be a load of the benchmark's own on the searches it measures. At the
end every write is replayed into faiss's own `IndexIVF` (the copy's codes, then
`add_with_ids`/`remove_ids`) and the searches are compared with it.
"""

from __future__ import annotations

import asyncio
import random
import shutil
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from telerag.documents.writer import DocumentText, DocumentWriter
from telerag.pipelines.datastores import open_retriever
from telerag.pipelines.retriever import DirectRetriever
from telerag.pipelines.text_encoder import TextEncoder
from telerag.pipelines.types import SearchOptions
from telerag.retrieval.datastore import Datastore
from telerag.retrieval.documents import WriteOutcome, WriteResult
from telerag.retrieval.generations import LOCK
from telerag.retrieval.ivf import faiss, same_results  # faiss untyped, as ivf reaches below its Python API
from telerag.retrieval.snapshot import search_snapshot

FRESHNESS_POLL_S = 5.0  # how long a write not visible at once is searched for again, before it counts as never


@dataclass(frozen=True)
class IngestConfig:
    writes: int = 200  # documents written (upserts and deletes), one request at a time
    writes_per_s: float | None = 2.0  # a write begins this often (or once the one before is answered); None: back to back
    searches_per_s: float | None = 10.0  # a search begins this often, whatever is in flight; None: `clients` back to back
    clients: int = 2  # searching back to back, where searches_per_s is None
    delete_share: float = 0.2
    new_share: float = 0.3  # of the upserts, documents the datastore did not hold
    top_k: int = 3
    seed: int = 0


@dataclass(frozen=True)
class IngestRow:
    """One line of the table: the searches alone or under writes, or the writes."""

    row: str
    count: int
    p50_ms: float | None
    p99_ms: float | None
    ratio_p99: float | None = None  # under writes over alone
    passages: int | None = None
    passages_per_s: float | None = None
    embedding_share: float | None = None  # of the writes' acknowledgment time, embedding
    overhead_ms_p99: float | None = None  # acknowledgment less the write's own embedding
    visible_share: float | None = None  # writes the first search after their acknowledgment saw
    freshness_ms_p99: float | None = None  # acknowledgment to visible (0: the first search after it)
    faiss_equal_share: float | None = None  # searches of the final state equal to faiss's after the same writes


@dataclass
class IngestReport:
    config: IngestConfig
    datastore: str
    rows: list[IngestRow] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"config": asdict(self.config), "datastore": self.datastore, "rows": [asdict(row) for row in self.rows]}


@dataclass
class _Write:
    change: DocumentText | str  # a document to write, or the id of one to delete
    probe: str  # text whose search finds (or, for a delete, no longer finds) the write
    probe_vector: np.ndarray | None = None  # the probe's embedding, made before the run
    ack_ms: float = 0.0
    embed_ms: float = 0.0
    passages: int = 0
    freshness_ms: float | None = None  # None: never visible within FRESHNESS_POLL_S
    result: WriteResult | None = None


def copy_datastore(source: Path, into: Path) -> Path:
    """The datastore directory at `source` (its generations, its log) copied to `into`/datastore."""
    target = into / "datastore"
    shutil.copytree(source, target, ignore=shutil.ignore_patterns(LOCK))
    return target


def plan_writes(datastore: Datastore, config: IngestConfig) -> list[_Write]:
    """Writes of the datastore's own documents: revised ones, new ones made of others' passages, deletes."""
    rng = random.Random(config.seed)
    rows = rng.sample(range(datastore.n_vectors), min(datastore.n_vectors, 4 * config.writes))
    passages = datastore.passages(datastore.ids_of(np.asarray(rows)))
    writes: list[_Write] = []
    deleted: set[str] = set()
    for i in range(config.writes):
        passage = passages[i % len(passages)]
        if rng.random() < config.delete_share and passage.doc_id not in deleted:
            deleted.add(passage.doc_id)
            writes.append(_Write(passage.doc_id, passage.text))
            continue
        other = passages[(i * 7 + 3) % len(passages)]
        text = f"{passage.text} {other.text} (revision {i} of the ingest benchmark)"
        doc_id = f"ingest-{i}" if rng.random() < config.new_share else passage.doc_id
        writes.append(_Write(DocumentText(doc_id, text, title=passage.title), text))
        deleted.discard(doc_id)
    return writes


async def _search_ms(retriever: DirectRetriever, question: str, k: int) -> float:
    started = time.perf_counter()
    await retriever.search([question], SearchOptions(top_k=k, prefetch=False))
    return (time.perf_counter() - started) * 1e3


async def _searches(retriever: DirectRetriever, questions: Sequence[str], config: IngestConfig) -> list[float]:
    """Every question once: one begun every 1/`searches_per_s` s whatever is in flight (an open
    load, as independent users make), or `clients` back to back; each one's latency (ms)."""
    if config.searches_per_s is not None:
        period = 1.0 / config.searches_per_s

        async def at(i: int, question: str) -> float:
            await asyncio.sleep(i * period)
            return await _search_ms(retriever, question, config.top_k)

        return list(await asyncio.gather(*(at(i, q) for i, q in enumerate(questions))))
    pending = list(questions)
    latencies: list[float] = []

    async def client() -> None:
        while pending:
            latencies.append(await _search_ms(retriever, pending.pop(), config.top_k))

    await asyncio.gather(*(client() for _ in range(config.clients)))
    return latencies


async def _visible(retriever: DirectRetriever, write: _Write) -> bool:
    """Whether the search of the write's text (by its vector), started now on the datastore as it
    is now, shows it (a delete: no longer shows it)."""
    vector = write.probe_vector
    assert vector is not None

    def search() -> set[str]:
        snapshot = retriever.live.snapshot()
        result = search_snapshot(retriever.retrieval_engine_for(snapshot.datastore), snapshot, vector[None], 10)
        return {passage.doc_id for passage in snapshot.passages_of([int(i) for i in result.ids[0] if i >= 0])}

    found = await asyncio.to_thread(search)
    return write.change not in found if isinstance(write.change, str) else write.change.doc_id in found


async def _write_all(
    writer: DocumentWriter, retriever: DirectRetriever, writes: list[_Write], embed_ms: list[float], per_s: float | None
) -> None:
    """Each write in turn (begun every 1/`per_s` s, or once the one before was checked):
    acknowledged, then searched for at once (again until it shows, at most `FRESHNESS_POLL_S`):
    freshness 0 when the first search after the acknowledgment shows it."""
    begun = time.perf_counter()
    for i, write in enumerate(writes):
        if per_s is not None:
            await asyncio.sleep(max(0.0, begun + i / per_s - time.perf_counter()))
        before = len(embed_ms)
        started = time.perf_counter()
        change = write.change
        (write.result,) = await (writer.delete([change]) if isinstance(change, str) else writer.upsert([change]))
        acknowledged = time.perf_counter()
        write.ack_ms = (acknowledged - started) * 1e3
        write.embed_ms = sum(embed_ms[before:])
        entry = write.result.document
        write.passages = 0 if entry is None or write.result.outcome is WriteOutcome.UNCHANGED else len(entry.passage_ids)
        first = True
        while True:
            if await _visible(retriever, write):
                write.freshness_ms = 0.0 if first else (time.perf_counter() - acknowledged) * 1e3
                break
            first = False
            if time.perf_counter() - acknowledged > FRESHNESS_POLL_S:
                break


def _p(values: Sequence[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if len(values) else None


async def ingest(retriever: DirectRetriever, questions: Sequence[str], config: IngestConfig) -> IngestReport:
    """The run (see the module's docstring) on `retriever`, over a datastore it may write."""
    embed_ms: list[float] = []
    embed = retriever.embed_passages

    def timed(texts: Sequence[str]) -> np.ndarray:
        started = time.perf_counter()
        vectors = embed(texts)
        embed_ms.append((time.perf_counter() - started) * 1e3)
        return vectors

    writer = DocumentWriter(retriever.live, timed)
    replay = FaissReplay(retriever.live.datastore, {e.doc_id: e.passage_ids for e in retriever.live.documents(limit=10**9)})
    writes = plan_writes(retriever.live.datastore, config)
    for write, vector in zip(writes, retriever.embedder.encode([w.probe for w in writes]), strict=True):
        write.probe_vector = vector
    try:
        await _searches(retriever, questions[:4], config)  # first use: not timed
        half = len(questions) // 2
        alone = await _searches(retriever, questions[:half], config)  # half before the writes, half after
        started = time.perf_counter()
        writing = asyncio.ensure_future(_write_all(writer, retriever, writes, embed_ms, config.writes_per_s))
        under = await _searches(retriever, questions, config)
        await writing
        seconds = time.perf_counter() - started
        alone += await _searches(retriever, questions[half:], config)
    finally:
        writer.close()
    for write in writes:
        assert write.result is not None
        replay.apply(write.result)
    report = IngestReport(config, retriever.live.where)
    report.rows.append(IngestRow("searches alone", len(alone), _p(alone, 50), _p(alone, 99)))
    ratio = None if not alone else (_p(under, 99) or 0.0) / (_p(alone, 99) or 1.0)
    report.rows.append(IngestRow("searches under writes", len(under), _p(under, 50), _p(under, 99), ratio_p99=ratio))
    acks = [w.ack_ms for w in writes]
    fresh = [w.freshness_ms for w in writes if w.freshness_ms is not None]
    passages = sum(w.passages for w in writes)
    report.rows.append(
        IngestRow(
            "writes",
            len(writes),
            _p(acks, 50),
            _p(acks, 99),
            passages=passages,
            passages_per_s=passages / seconds if seconds else None,
            embedding_share=sum(w.embed_ms for w in writes) / sum(acks) if sum(acks) else None,
            overhead_ms_p99=_p([w.ack_ms - w.embed_ms for w in writes], 99),
            visible_share=len(fresh) / len(writes) if writes else None,
            freshness_ms_p99=_p(fresh, 99),
            faiss_equal_share=await replay.equal_share(retriever, questions, config.top_k),
        )
    )
    return report


class FaissReplay:
    """faiss's own `IndexIVF` over the datastore's codes, the same writes applied as
    `add_with_ids` and `remove_ids`: what a search of the final state must equal."""

    def __init__(self, datastore: Datastore, documents: dict[str, tuple[int, ...]]) -> None:
        self.documents = dict(documents)
        self.index: Any
        self.index, self._quantizer = datastore.codec.empty_faiss_index(datastore.centroids, datastore.codec_params)
        invlists = faiss.downcast_InvertedLists(self.index.invlists)
        for cluster in range(datastore.nlist):
            start, end = int(datastore.offsets[cluster]), int(datastore.offsets[cluster + 1])
            if end > start:
                ids = np.ascontiguousarray(datastore.ids_of(np.arange(start, end)))
                codes = np.ascontiguousarray(datastore.vectors[start:end]).view(np.uint8)
                invlists.add_entries(cluster, end - start, faiss.swig_ptr(ids), faiss.swig_ptr(codes))
        self.index.ntotal = datastore.n_vectors

    def apply(self, result: WriteResult) -> None:
        if result.outcome in (WriteOutcome.UNCHANGED, WriteOutcome.NOT_FOUND):
            return
        old = self.documents.pop(result.doc_id, ())
        if old:
            self.index.remove_ids(np.asarray(old, dtype=np.int64))
        if result.document is not None:
            self.documents[result.doc_id] = result.document.passage_ids

    async def equal_share(self, retriever: DirectRetriever, questions: Sequence[str], k: int) -> float:
        """The share of `questions` whose search of the final state equals faiss's (the written
        passages' vectors are the datastore's own: added from its snapshot)."""
        snapshot = retriever.live.snapshot()
        delta = snapshot.delta
        living = ~snapshot.is_deleted(delta.ids)
        if living.any():
            codec, params = snapshot.datastore.codec, snapshot.datastore.codec_params
            vectors = codec.decode_exact(delta.codes[living], params).astype(np.float32)
            self.index.add_with_ids(vectors, delta.ids[living])
        equal = 0
        nprobe = retriever.retrieval_engine.nprobe
        queries = await retriever.embed(list(questions))
        ref_scores, ref_ids = self.index.search(queries.vectors, k, params=faiss.SearchParametersIVF(nprobe=nprobe))
        for question, scores, ids in zip(questions, ref_scores, ref_ids, strict=True):
            outcome = await retriever.search([question], SearchOptions(top_k=k, nprobe=nprobe, prefetch=False))
            found = outcome.documents[0]
            mine_ids = np.asarray([d.id for d in found] + [-1] * (k - len(found)), dtype=np.int64)
            mine_scores = np.asarray([d.score for d in found] + [float(scores[-1])] * (k - len(found)), dtype=np.float32)
            equal += same_results(mine_ids, mine_scores, ids, scores)
        return equal / len(questions) if questions else 1.0


def run_ingest(source: Path, embedder: TextEncoder, questions: Sequence[str], config: IngestConfig) -> IngestReport:
    """`ingest` on a copy of the datastore at `source`, removed afterwards."""
    with tempfile.TemporaryDirectory(prefix="telerag-ingest-") as scratch:
        copy = copy_datastore(source, Path(scratch))
        retriever = open_retriever(copy, embedder, device="cpu", writable=True, verify_checksums=False)
        try:
            report = asyncio.run(ingest(retriever, questions, config))
        finally:
            retriever.close()
    report.datastore = str(source)
    return report


def format_table(report: IngestReport) -> str:
    head = f"{'row':<22}{'count':>7}{'p50 ms':>9}{'p99 ms':>9}  detail"
    lines = [f"bench ingest on a copy of {report.datastore}", head]
    for row in report.rows:
        p50 = "-" if row.p50_ms is None else f"{row.p50_ms:.1f}"
        p99 = "-" if row.p99_ms is None else f"{row.p99_ms:.1f}"
        detail = []
        if row.ratio_p99 is not None:
            detail.append(f"p99 {row.ratio_p99:.2f}x of alone")
        if row.passages is not None:
            detail.append(f"{row.passages} passages, {row.passages_per_s or 0:.1f}/s")
            detail.append(f"embedding {100 * (row.embedding_share or 0):.0f}% of the acknowledgments")
            detail.append(f"p99 beyond embedding {row.overhead_ms_p99 or 0:.1f} ms")
            detail.append(f"visible at the first search after {100 * (row.visible_share or 0):.0f}%")
            detail.append(f"freshness p99 {row.freshness_ms_p99 if row.freshness_ms_p99 is not None else '-'} ms")
            detail.append(f"equal to faiss {100 * (row.faiss_equal_share or 0):.0f}%")
        lines.append(f"{row.row:<22}{row.count:>7}{p50:>9}{p99:>9}  {'; '.join(detail)}")
    return "\n".join(lines)
