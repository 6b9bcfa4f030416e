"""A re-ranker over a search's candidates: a cross-encoder reads each (query, passage) pair whole
and scores it, which an embedding's inner product cannot (it never sees the two together). It is
a decorator of a `Ranking`: the ranking's top `candidates` are scored, reordered (ties to the
smaller id) and cut to k; its scores are the cross-encoder's, in [0, 1] for a one-label model
(sentence-transformers applies the sigmoid). All of a batch's pairs are scored in one call, so a
batch of requests is re-ranked together. Off unless `retrieval.reranker` names a local model
directory: no package ships one, and nothing is downloaded.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import numpy as np

from telerag.retrieval.ranking import HYBRID_CANDIDATES, DenseSearch, Ranked, Ranking, RankTrace, SearchMode
from telerag.retrieval.shards import FAISS_PAD_SCORE

if TYPE_CHECKING:
    from telerag.retrieval.snapshot import Snapshot


class Reranker(Protocol):
    def scores(self, pairs: Sequence[tuple[str, str]]) -> np.ndarray:
        """One float per (query, passage) pair: higher is more relevant."""
        ...


class CrossEncoderReranker:
    """sentence-transformers' `CrossEncoder` from a local directory, one call at a time."""

    def __init__(self, path: Path | str, *, device: str = "cpu", batch_size: int = 32) -> None:
        from sentence_transformers import CrossEncoder  # torch: only where a re-ranker is configured

        self.path, self.batch_size = Path(path), batch_size
        self._model = CrossEncoder(str(path), device=device, local_files_only=True)
        self._lock = threading.Lock()

    def scores(self, pairs: Sequence[tuple[str, str]]) -> np.ndarray:
        if not pairs:
            return np.zeros(0, np.float32)
        with self._lock:
            found = self._model.predict(list(pairs), batch_size=self.batch_size, show_progress_bar=False)
        return np.asarray(found, dtype=np.float32).reshape(len(pairs))


@dataclass(frozen=True)
class RerankedRanking:
    """`inner`'s top `candidates`, reordered by `reranker`."""

    inner: Ranking
    reranker: Reranker
    candidates: int = HYBRID_CANDIDATES

    @property
    def mode(self) -> SearchMode:
        return self.inner.mode

    @property
    def uses_vectors(self) -> bool:
        return self.inner.uses_vectors

    def rank(
        self, snapshot: Snapshot, texts: Sequence[str], k: int, dense: DenseSearch, trace: RankTrace | None = None
    ) -> Ranked:
        _, ids = self.inner.rank(snapshot, texts, max(k, self.candidates), dense, trace)
        started = time.perf_counter()
        rows = [[int(i) for i in row if i >= 0] for row in ids]
        passages = snapshot.passages_of([i for row in rows for i in row])
        pairs: list[tuple[str, str]] = []
        at = 0
        for r, row in enumerate(rows):
            pairs += [(texts[r], f"{p.title}\n{p.text}") for p in passages[at : at + len(row)]]
            at += len(row)
        scored = self.reranker.scores(pairs)
        out_scores = np.full((len(rows), k), FAISS_PAD_SCORE, dtype=np.float32)
        out_ids = np.full((len(rows), k), -1, dtype=np.int64)
        at = 0
        for r, row in enumerate(rows):
            row_ids, row_scores = np.asarray(row, np.int64), scored[at : at + len(row)]
            at += len(row)
            top = np.lexsort((row_ids, -row_scores))[:k]
            out_scores[r, : len(top)], out_ids[r, : len(top)] = row_scores[top], row_ids[top]
        if trace is not None:
            trace.rerank_ms += (time.perf_counter() - started) * 1e3
        return out_scores, out_ids
