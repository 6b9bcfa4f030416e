"""`telerag bench retrieval`'s early-stop phase: faiss at the configured nprobe and the engine's
search with exact early stop (`experiments.early_stop`), timed by turns on each batch, its answers
checked against faiss's, and the share of the probed lists it scanned."""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
from tqdm.auto import tqdm

from telerag.retrieval.early_stop import EarlyStopSearch
from telerag.retrieval.engine import RetrievalEngine
from telerag.retrieval.ivf import same_results


@dataclass
class EarlyStopTimes:
    """faiss's search and the early-stopped one, timed by turns on each batch."""

    faiss_ms: list[float]
    early_stop_ms: list[float]
    identical: list[bool]
    lists_scanned_fraction: float | None


def early_stop_phase(
    engine: RetrievalEngine,
    q_out: np.ndarray,
    batches: list[slice],
    references: list[tuple[np.ndarray, np.ndarray]],
    topk: int,
    progress: bool,
) -> EarlyStopTimes:
    """faiss (tuned) and the engine's search with early stop and no cache (faiss's lists, probed
    and scanned with early stop), in turn on each batch (the first, a warm-up, left out)."""
    early = RetrievalEngine(engine.datastore, device="cpu", nprobe=engine.nprobe, early_stop=True)
    assert isinstance(early.cpu_half, EarlyStopSearch)
    phase = EarlyStopTimes([], [], [], None)
    for i, batch in enumerate(tqdm(batches, desc="faiss vs early stop", disable=not progress)):
        t0 = time.perf_counter()
        engine.index.search(q_out[batch], topk, engine.nprobe)
        faiss_ms = (time.perf_counter() - t0) * 1e3
        t0 = time.perf_counter()
        result = early.search(q_out[batch], topk, engine.nprobe)
        early_ms = (time.perf_counter() - t0) * 1e3
        ref_scores, ref_ids = references[i]
        phase.identical.extend(
            same_results(result.ids[j], result.scores[j], ref_ids[j], ref_scores[j]) for j in range(len(ref_ids))
        )
        if i:
            phase.faiss_ms.append(faiss_ms)
            phase.early_stop_ms.append(early_ms)
    phase.lists_scanned_fraction = early.cpu_half.counts.scanned_fraction
    early.close()
    return phase
