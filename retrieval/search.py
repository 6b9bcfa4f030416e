"""The device half of cooperative search and the merge of both halves.

The device scans only the resident clusters of each query's own C_out (never the whole
buffer), so together with faiss scanning the rest the answer is exactly IVF at that nprobe.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from retrieval.cache import Segment
from retrieval.ivf import FAISS_PAD_SCORE

SCAN_CHUNK_BYTES = 256 << 20  # bound on the gathered rows held at once


def _rows_and_ids(segments: Sequence[Segment], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Buffer rows and vector ids of the given segments, built on the device from their bounds."""
    bounds = np.array([(s.start, s.length, s.host_start) for s in segments], dtype=np.int64).reshape(-1, 3)
    lengths = torch.from_numpy(bounds[:, 1]).to(device, non_blocking=True)
    total = int(bounds[:, 1].sum())
    first = np.concatenate(([0], np.cumsum(bounds[:-1, 1])))
    within = torch.arange(total, device=device)
    shift = torch.from_numpy(np.stack([bounds[:, 0] - first, bounds[:, 2] - first])).to(device, non_blocking=True)
    rows = torch.repeat_interleave(shift[0], lengths, output_size=total) + within
    ids = torch.repeat_interleave(shift[1], lengths, output_size=total) + within
    return rows, ids


def scan_resident(
    buffer: torch.Tensor, queries: torch.Tensor, segments: Sequence[Sequence[Segment]], k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k (scores, ids) of each query over its own segments of `buffer`; -inf / -1 padded."""
    n, dim = queries.shape
    scores_out = torch.full((n, k), float("-inf"), dtype=torch.float32, device=buffer.device)
    ids_out = torch.full((n, k), -1, dtype=torch.int64, device=buffer.device)
    chunk_rows = max(1, SCAN_CHUNK_BYTES // (dim * 4))
    for i, query_segments in enumerate(segments):
        if not query_segments:
            continue
        rows, ids = _rows_and_ids(query_segments, buffer.device)
        best_scores, best_ids = scores_out[i], ids_out[i]
        for start in range(0, len(rows), chunk_rows):
            block = buffer.index_select(0, rows[start : start + chunk_rows]).float()
            scores = block @ queries[i]
            cand_scores = torch.cat([best_scores, scores])
            cand_ids = torch.cat([best_ids, ids[start : start + chunk_rows]])
            top = torch.topk(cand_scores, k).indices
            best_scores, best_ids = cand_scores[top], cand_ids[top]
        scores_out[i], ids_out[i] = best_scores, best_ids
    return scores_out, ids_out


def merge_topk(
    parts: Sequence[tuple[torch.Tensor, torch.Tensor]], k: int
) -> tuple[np.ndarray, np.ndarray]:
    """Merge per-query top-k lists: score descending, ties broken by id ascending; pad like faiss."""
    scores = torch.cat([p[0] for p in parts], dim=1)
    ids = torch.cat([p[1] for p in parts], dim=1)
    scores = torch.where(ids < 0, torch.tensor(float("-inf"), device=scores.device), scores)
    by_id = torch.sort(ids, dim=1, stable=True).indices
    scores, ids = scores.gather(1, by_id), ids.gather(1, by_id)
    by_score = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :k]
    scores, ids = scores.gather(1, by_score), ids.gather(1, by_score)
    scores = torch.where(ids < 0, torch.tensor(FAISS_PAD_SCORE, device=scores.device), scores)
    return scores.cpu().numpy().astype(np.float32, copy=False), ids.cpu().numpy()
