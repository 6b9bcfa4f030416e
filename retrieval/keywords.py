"""BM25 over a live datastore's passages: the keyword half of a search, exact over one snapshot.

The index has the two parts a snapshot has. The generation's passages (which never change) are
tokenized once, on the first keyword search of that generation, into postings held in memory;
the passages written since are added to postings of their own as each write is applied, from the
write's log record (replaying the log after a crash rebuilds them), so a passage is searchable by
its words in the same write that makes it searchable by its vector. A snapshot reads the delta's
postings up to its own last passage id (ids are handed out rising) and leaves out its deleted ids,
so the keyword half sees exactly the passages the dense half does, with a filter's too.

Scores are Okapi BM25 with Lucene's parameters (k1 1.2, b 0.75, idf ln(1 + (N - df + 0.5) /
(df + 0.5))), its statistics (N, the mean length, each term's df) over the passages the search
may return: the snapshot's living ones, those a filter leaves. A passage's text is its title, a
newline, its text; tokens are runs of word characters, case-folded, Lucene's English stop words
left out, nothing stemmed; each distinct word of a query counts once. Ties go to the smaller id,
as the dense half's do.
"""

from __future__ import annotations

import bisect
import logging
import re
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from telerag.retrieval.corpus import Passage
from telerag.retrieval.shards import FAISS_PAD_SCORE

if TYPE_CHECKING:
    from telerag.retrieval.datastore import Datastore
    from telerag.retrieval.snapshot import Snapshot

log = logging.getLogger(__name__)

K1 = 1.2
B = 0.75
TOKEN = re.compile(r"\w+")
STOP_WORDS_TEXT = (
    "a an and are as at be but by for if in into is it no not of on or such that the their then there these they this to "
    "was will with"
)
STOP_WORDS = frozenset(STOP_WORDS_TEXT.split())  # Lucene's EnglishAnalyzer default stop set
BUILD_BLOCK = 4096  # the generation's passages read at once when its postings are built


def tokens(text: str) -> list[str]:
    """`text`'s words as the index and its queries read them."""
    return [token for token in TOKEN.findall(text.casefold()) if token not in STOP_WORDS]


def passage_terms(passage: Passage) -> Counter[str]:
    """Each word of a passage (its title and text) and how often it occurs."""
    return Counter(tokens(f"{passage.title}\n{passage.text}"))


@dataclass(frozen=True)
class Postings:
    """The passages holding one term: their ids, the term's count in each, and each one's length."""

    ids: np.ndarray  # int64
    tf: np.ndarray  # float64
    lengths: np.ndarray  # float64

    @classmethod
    def empty(cls) -> Postings:
        return cls(np.zeros(0, np.int64), np.zeros(0), np.zeros(0))

    def __len__(self) -> int:
        return len(self.ids)

    def where(self, keep: np.ndarray) -> Postings:
        return Postings(self.ids[keep], self.tf[keep], self.lengths[keep])


class GenerationKeywords:
    """A generation's postings, term by term (compressed sparse rows over a sorted vocabulary),
    built from its passages on first need: a datastore only ever searched by meaning never pays."""

    def __init__(self, datastore: Datastore) -> None:
        self.datastore = datastore
        self._lock = threading.Lock()
        self._built = False
        self._vocabulary: dict[str, int] = {}
        self._starts = np.zeros(1, np.int64)
        self._ids = np.zeros(0, np.int64)
        self._tf = np.zeros(0, np.float32)
        self._lengths = np.zeros(0, np.float32)  # each posting's passage length
        self._row_lengths = np.zeros(0, np.float32)  # each row's passage length
        self._total = 0.0

    def postings(self, term: str) -> Postings:
        self._build()
        at = self._vocabulary.get(term)
        if at is None:
            return Postings.empty()
        rows = slice(self._starts[at], self._starts[at + 1])
        return Postings(self._ids[rows], self._tf[rows].astype(np.float64), self._lengths[rows].astype(np.float64))

    def lengths_of(self, rows: np.ndarray) -> np.ndarray:
        """The lengths of the generation's passages at `rows`."""
        self._build()
        return self._row_lengths[rows].astype(np.float64)

    def total_length(self) -> float:
        self._build()
        return self._total

    def _build(self) -> None:
        with self._lock:
            if self._built:
                return
            started = time.perf_counter()
            datastore = self.datastore
            vocabulary: dict[str, int] = {}
            terms: list[int] = []
            rows: list[int] = []
            counts: list[int] = []
            lengths = np.zeros(datastore.n_vectors, np.float32)
            if datastore.has_passages:
                for start in range(0, datastore.n_vectors, BUILD_BLOCK):
                    block = np.arange(start, min(start + BUILD_BLOCK, datastore.n_vectors))
                    for row, passage in zip(block.tolist(), datastore.passages(datastore.ids_of(block)), strict=True):
                        found = passage_terms(passage)
                        lengths[row] = sum(found.values())
                        for term, count in found.items():
                            terms.append(vocabulary.setdefault(term, len(vocabulary)))
                            rows.append(row)
                            counts.append(count)
            term_of = np.asarray(terms, dtype=np.int64)
            order = np.argsort(term_of, kind="stable")
            posting_rows = np.asarray(rows, dtype=np.int64)[order]
            self._starts = np.concatenate(([0], np.cumsum(np.bincount(term_of, minlength=len(vocabulary))))).astype(np.int64)
            self._ids = datastore.ids_of(posting_rows).astype(np.int64)
            self._tf = np.asarray(counts, dtype=np.float32)[order]
            self._lengths = lengths[posting_rows]
            self._row_lengths = lengths
            self._vocabulary = vocabulary
            self._total = float(lengths.sum(dtype=np.float64))
            self._built = True
            if datastore.n_vectors:
                log.info(
                    "%s: keyword postings of %d passages built in %.1f s (%d terms)",
                    datastore.where,
                    datastore.n_vectors,
                    time.perf_counter() - started,
                    len(vocabulary),
                )


class DeltaKeywords:
    """The postings of the passages written since the generation, appended as each write is applied
    (in id order, ids rising); a snapshot reads each term's up to its own last id. Appends and
    reads may run at once: an entry a snapshot reads was appended before the snapshot was published."""

    def __init__(self) -> None:
        self._postings: dict[str, tuple[list[int], list[int], list[int]]] = {}
        self._ids: list[int] = []  # every passage added, in id order
        self._lengths: list[int] = []
        self._totals: list[int] = []  # the lengths' running sum

    def add(self, passage_id: int, passage: Passage) -> None:
        found = passage_terms(passage)
        length = sum(found.values())
        for term, count in found.items():
            ids, tf, lengths = self._postings.setdefault(term, ([], [], []))
            ids.append(passage_id)
            tf.append(count)
            lengths.append(length)
        self._totals.append(length + (self._totals[-1] if self._totals else 0))
        self._lengths.append(length)
        self._ids.append(passage_id)  # last: a reader bisects these, then reads the others

    def postings(self, term: str, last_id: int) -> Postings:
        """The term's postings of passages up to `last_id`."""
        found = self._postings.get(term)
        if found is None:
            return Postings.empty()
        ids, tf, lengths = found
        n = bisect.bisect_right(ids, last_id)
        return Postings(np.asarray(ids[:n], np.int64), np.asarray(tf[:n], np.float64), np.asarray(lengths[:n], np.float64))

    def lengths_of(self, ids: np.ndarray) -> np.ndarray:
        """The lengths of the delta's passages `ids` (each one added)."""
        if not len(ids):
            return np.zeros(0)
        n = bisect.bisect_right(self._ids, int(ids.max()))
        held = np.asarray(self._ids[:n], np.int64)
        return np.asarray(self._lengths[:n], np.float64)[np.searchsorted(held, ids)]

    def total_length(self, last_id: int) -> float:
        n = bisect.bisect_right(self._ids, last_id)
        return float(self._totals[n - 1]) if n else 0.0


@dataclass(frozen=True)
class KeywordIndex:
    """The keyword half of one snapshot: the generation's postings and the delta's up to
    `last_id` (the snapshot's last delta passage; -1: none)."""

    generation: GenerationKeywords
    delta: DeltaKeywords
    last_id: int

    def postings(self, term: str) -> Postings:
        base, added = self.generation.postings(term), self.delta.postings(term, self.last_id)
        if not len(added):
            return base
        return Postings(
            np.concatenate((base.ids, added.ids)),
            np.concatenate((base.tf, added.tf)),
            np.concatenate((base.lengths, added.lengths)),
        )


def keyword_search(snapshot: Snapshot, texts: Sequence[str], k: int) -> tuple[np.ndarray, np.ndarray]:
    """Each text's top k passages of `snapshot` by BM25 (see the module's docstring): (scores
    float32, ids int64), each (len(texts), k), padded as faiss pads (-1 ids) where fewer match."""
    index = snapshot.keywords
    out_scores = np.full((len(texts), k), FAISS_PAD_SCORE, dtype=np.float32)
    out_ids = np.full((len(texts), k), -1, dtype=np.int64)
    n = snapshot.passages
    if n <= 0:
        return out_scores, out_ids
    mean_length = max(_living_length(snapshot) / n, 1e-9)
    for row, text in enumerate(texts):
        found_ids: list[np.ndarray] = []
        found_scores: list[np.ndarray] = []
        for term in sorted(set(tokens(text))):
            postings = index.postings(term)
            if len(snapshot.deleted):
                postings = postings.where(~snapshot.is_deleted(postings.ids))
            df = len(postings)
            if not df:
                continue
            idf = np.log1p((n - df + 0.5) / (df + 0.5))
            norm = K1 * (1.0 - B + B * postings.lengths / mean_length)
            found_ids.append(postings.ids)
            found_scores.append(idf * postings.tf * (K1 + 1.0) / (postings.tf + norm))
        if not found_ids:
            continue
        ids, at = np.unique(np.concatenate(found_ids), return_inverse=True)
        scores = np.bincount(at, weights=np.concatenate(found_scores), minlength=len(ids))
        top = np.lexsort((ids, -scores))[:k]
        out_scores[row, : len(top)] = scores[top]
        out_ids[row, : len(top)] = ids[top]
    return out_scores, out_ids


def _living_length(snapshot: Snapshot) -> float:
    """The total length of the snapshot's living passages: every passage's, less the deleted ones'."""
    index = snapshot.keywords
    total = index.generation.total_length() + index.delta.total_length(index.last_id)
    if len(snapshot.deleted):
        rows = snapshot.datastore.rows_of(snapshot.deleted)
        base = rows >= 0
        total -= float(index.generation.lengths_of(rows[base]).sum())
        total -= float(index.delta.lengths_of(snapshot.deleted[~base]).sum())
    return total
