"""Which engine should hold the keyword half: measured on the configured datastore's passages and
the Wikipedia questions. Each engine builds its index over the same passages, answers the same
questions (top 10), and takes writes as a serving datastore does: a document's passages replaced,
then a document deleted, each durable before the next.

- `postings` (ours, `retrieval.keywords`): the generation's postings in memory, a write's
  appended from its log record; the record is the vectors' own, so a write costs no second sync,
  and a search reads exactly the snapshot the dense half does.
- `sqlite-fts5`: the standard library's SQLite, an FTS5 table on disk (WAL, synchronous FULL): a
  write is a transaction of its own, beside the vectors' log, and its `bm25()` counts every row
  the table holds, so a snapshot's searches see what the table holds now, not what the dense half reads.
- `bm25s`, `tantivy`: measured where installed (neither is a dependency). bm25s has no update: a
  write rebuilds the index. tantivy commits a write and reloads its searcher.

`overlap@10`: the share of ours top 10 each engine returns too (tokenizers differ: FTS5's and
tantivy's keep stop words, bm25s stems nothing by default here either).
"""

from __future__ import annotations

import sqlite3
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from telerag.retrieval.corpus import Passage
from telerag.retrieval.keywords import GenerationKeywords, keyword_search, tokens
from telerag.retrieval.live import LiveDatastore

TOP = 10
WRITES = 20  # documents replaced, then as many deleted, one durable write at a time


@dataclass(frozen=True)
class EngineRow:
    engine: str
    build_s: float
    query_p50_ms: float
    write_ms: float  # one document's passages replaced, durable
    delete_ms: float  # one document deleted, durable
    overlap: float  # of ours top 10, the share this engine returns too
    note: str = ""


def text_of(passage: Passage) -> str:
    return f"{passage.title}\n{passage.text}"


def _p50(run: Callable[[str], list[int]], questions: Sequence[str]) -> tuple[float, list[list[int]]]:
    times, found = [], []
    for question in questions:
        started = time.perf_counter()
        found.append(run(question))
        times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times), found


def _overlap(found: list[list[int]], ours: list[list[int]]) -> float:
    shares = [len(set(f) & set(o)) / len(o) for f, o in zip(found, ours, strict=True) if o]
    return float(np.mean(shares)) if shares else 1.0


def measure_ours(live: LiveDatastore, questions: Sequence[str], writes: list[Passage]) -> tuple[EngineRow, list[list[int]]]:
    snapshot = live.snapshot()
    started = time.perf_counter()
    GenerationKeywords(snapshot.datastore).total_length()  # a fresh build of the generation's postings
    build_s = time.perf_counter() - started
    snapshot.keywords.generation.total_length()  # the snapshot's own, built before the queries are timed
    p50, found = _p50(lambda q: [int(i) for i in keyword_search(snapshot, [q], TOP)[1][0] if i >= 0], questions)
    delta = snapshot.keywords.delta.__class__()
    started = time.perf_counter()
    for at, passage in enumerate(writes):
        delta.add(10**9 + at, passage)
    write_ms = (time.perf_counter() - started) * 1e3 / len(writes)
    row = EngineRow("postings (ours)", build_s, p50, write_ms, 0.0, 1.0, "in the vectors' log record: no second sync")
    return row, found


def measure_fts5(passages: Sequence[tuple[int, Passage]], questions: Sequence[str], writes: list[Passage], ours) -> EngineRow:
    with tempfile.TemporaryDirectory() as folder:
        db = sqlite3.connect(Path(folder) / "fts.db", isolation_level=None)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=FULL")
        db.execute("CREATE VIRTUAL TABLE p USING fts5(body, tokenize='unicode61')")
        started = time.perf_counter()
        db.execute("BEGIN")
        db.executemany("INSERT INTO p(rowid, body) VALUES (?, ?)", ((i, text_of(p)) for i, p in passages))
        db.execute("COMMIT")
        build_s = time.perf_counter() - started

        def query(question: str) -> list[int]:
            words = " OR ".join(f'"{t}"' for t in dict.fromkeys(tokens(question)))
            if not words:
                return []
            return [r[0] for r in db.execute("SELECT rowid FROM p WHERE p MATCH ? ORDER BY rank LIMIT ?", (words, TOP))]

        p50, found = _p50(query, questions)
        targets = [i for i, _ in passages[: len(writes)]]
        started = time.perf_counter()
        for target, passage in zip(targets, writes, strict=True):
            db.execute("BEGIN")
            db.execute("DELETE FROM p WHERE rowid = ?", (target,))
            db.execute("INSERT INTO p(rowid, body) VALUES (?, ?)", (target, text_of(passage)))
            db.execute("COMMIT")
        write_ms = (time.perf_counter() - started) * 1e3 / len(writes)
        started = time.perf_counter()
        for target in targets:
            db.execute("BEGIN")
            db.execute("DELETE FROM p WHERE rowid = ?", (target,))
            db.execute("COMMIT")
        delete_ms = (time.perf_counter() - started) * 1e3 / len(targets)
        db.close()
    return EngineRow("sqlite-fts5", build_s, p50, write_ms, delete_ms, _overlap(found, ours), "a transaction of its own")


def measure_bm25s(passages: Sequence[tuple[int, Passage]], questions: Sequence[str], ours) -> EngineRow | None:
    try:
        import bm25s
    except ImportError:
        return None
    ids = [i for i, _ in passages]
    corpus = [text_of(p) for _, p in passages]

    def build() -> bm25s.BM25:
        index = bm25s.BM25()
        index.index(bm25s.tokenize(corpus, stopwords="en", show_progress=False), show_progress=False)
        return index

    started = time.perf_counter()
    index = build()
    build_s = time.perf_counter() - started

    def query(question: str) -> list[int]:
        found, _ = index.retrieve(bm25s.tokenize([question], stopwords="en", show_progress=False), k=TOP, show_progress=False)
        return [ids[int(r)] for r in found[0]]

    p50, found = _p50(query, questions)
    return EngineRow("bm25s", build_s, p50, build_s * 1e3, build_s * 1e3, _overlap(found, ours), "no update: a write rebuilds")


def measure_tantivy(
    passages: Sequence[tuple[int, Passage]], questions: Sequence[str], writes: list[Passage], ours
) -> EngineRow | None:
    try:
        import tantivy
    except ImportError:
        return None
    schema_builder = tantivy.SchemaBuilder()
    schema_builder.add_integer_field("id", stored=True, indexed=True)
    schema_builder.add_text_field("body", stored=False)
    schema = schema_builder.build()
    with tempfile.TemporaryDirectory() as folder:
        index = tantivy.Index(schema, path=folder)
        writer = index.writer()
        started = time.perf_counter()
        for i, passage in passages:
            writer.add_document(tantivy.Document(id=i, body=text_of(passage)))
        writer.commit()
        index.reload()
        build_s = time.perf_counter() - started

        def query(question: str) -> list[int]:
            words = " OR ".join(dict.fromkeys(tokens(question)))
            if not words:
                return []
            searcher = index.searcher()
            hits = searcher.search(index.parse_query(words, ["body"]), TOP).hits
            return [searcher.doc(address)["id"][0] for _, address in hits]

        p50, found = _p50(query, questions)
        targets = [i for i, _ in passages[: len(writes)]]
        started = time.perf_counter()
        for target, passage in zip(targets, writes, strict=True):
            writer.delete_documents("id", target)
            writer.add_document(tantivy.Document(id=target, body=text_of(passage)))
            writer.commit()
            index.reload()
        write_ms = (time.perf_counter() - started) * 1e3 / len(writes)
        started = time.perf_counter()
        for target in targets:
            writer.delete_documents("id", target)
            writer.commit()
            index.reload()
        delete_ms = (time.perf_counter() - started) * 1e3 / len(targets)
    return EngineRow("tantivy", build_s, p50, write_ms, delete_ms, _overlap(found, ours), "a commit and a reload each")


def keyword_engines(live: LiveDatastore, questions: Sequence[str]) -> list[EngineRow]:
    """Every engine over `live`'s passages (its current snapshot's generation), in the order above."""
    datastore = live.snapshot().datastore
    ids = datastore.ids_of(np.arange(datastore.n_vectors))
    passages = list(zip(ids.tolist(), datastore.passages(ids), strict=True))
    writes = [Passage(f"w{i}", p.title, p.text[::-1]) for i, (_, p) in enumerate(passages[-WRITES:])]
    mine, ours = measure_ours(live, questions, writes)
    rows = [mine, measure_fts5(passages, questions, writes, ours)]
    rows += [row for row in (measure_bm25s(passages, questions, ours), measure_tantivy(passages, questions, writes, ours)) if row]
    return rows


def format_table(rows: list[EngineRow], passages: int, questions: int) -> str:
    lines = [
        f"{passages} passages, {questions} questions, top {TOP}; a write: one passage replaced, durable",
        f"{'engine':<18}{'build s':>9}{'query p50 ms':>14}{'write ms':>10}{'delete ms':>11}{'overlap@10':>12}  note",
    ]
    for r in rows:
        times = f"{r.build_s:>9.2f}{r.query_p50_ms:>14.2f}{r.write_ms:>10.2f}{r.delete_ms:>11.2f}"
        lines.append(f"{r.engine:<18}{times}{r.overlap:>12.3f}  {r.note}")
    return "\n".join(lines)
