"""The device half of cooperative search and the merge of both halves.

The device scans only the resident clusters of each query's own C_out (never the whole
buffer), so together with faiss scanning the rest the answer is exactly IVF at that nprobe.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from retrieval.cache import Segment
from retrieval.ivf import FAISS_PAD_SCORE

SCAN_CHUNK_BYTES = 256 << 20  # bound on the gathered rows held at once


def _union_rows(
    resident: Mapping[int, Sequence[Segment]], clusters: Sequence[int], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Buffer rows, vector ids, and position in `clusters` of every row of those clusters,
    built on the device from the segment bounds (a few small copies, not one per row)."""
    bounds = np.array(
        [(s.start, s.length, s.host_start, pos) for pos, c in enumerate(clusters) for s in resident[c]], dtype=np.int64
    ).reshape(-1, 4)
    total = int(bounds[:, 1].sum())
    first = np.concatenate(([0], np.cumsum(bounds[:-1, 1])))
    table = torch.from_numpy(np.stack([bounds[:, 0] - first, bounds[:, 2] - first, bounds[:, 3], bounds[:, 1]]))
    table = table.to(device, non_blocking=True)
    within = torch.arange(total, device=device)
    rows = torch.repeat_interleave(table[0], table[3], output_size=total) + within
    ids = torch.repeat_interleave(table[1], table[3], output_size=total) + within
    owner = torch.repeat_interleave(table[2], table[3], output_size=total)
    return rows, ids, owner


def scan_resident(
    buffer: torch.Tensor,
    queries: torch.Tensor,
    resident: Mapping[int, Sequence[Segment]],
    probes: Sequence[Sequence[int]],
    k: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k (scores, ids) of each query over the resident clusters it probes; -inf / -1 padded.

    The union of the batch's probed clusters is read once (one matrix product against all the
    queries); a score counts only for the queries that probe that row's cluster.
    """
    n, dim = queries.shape
    best_scores = torch.full((n, k), float("-inf"), dtype=torch.float32, device=buffer.device)
    best_ids = torch.full((n, k), -1, dtype=torch.int64, device=buffer.device)
    union = sorted({c for query_probes in probes for c in query_probes})
    if not union:
        return best_scores, best_ids
    position = {c: i for i, c in enumerate(union)}
    membership = np.zeros((n, len(union)), dtype=bool)
    for i, query_probes in enumerate(probes):
        membership[i, [position[c] for c in query_probes]] = True
    member = torch.from_numpy(membership).to(buffer.device, non_blocking=True)
    rows, ids, owner = _union_rows(resident, union, buffer.device)
    chunk_rows = max(1, SCAN_CHUNK_BYTES // (dim * 4))
    minus_inf = torch.tensor(float("-inf"), device=buffer.device)
    for start in range(0, len(rows), chunk_rows):
        block = buffer.index_select(0, rows[start : start + chunk_rows]).float()
        scores = queries @ block.T
        scores = torch.where(member[:, owner[start : start + chunk_rows]], scores, minus_inf)
        cand_scores = torch.cat([best_scores, scores], dim=1)
        cand_ids = torch.cat([best_ids, ids[start : start + chunk_rows].expand(n, -1)], dim=1)
        top = torch.topk(cand_scores, k, dim=1).indices
        best_scores, best_ids = cand_scores.gather(1, top), cand_ids.gather(1, top)
    best_ids = torch.where(torch.isinf(best_scores), torch.tensor(-1, device=buffer.device), best_ids)
    return best_scores, best_ids


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
