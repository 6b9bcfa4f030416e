"""The device half of cooperative search and the merge of both halves on the device.

The device scans only the resident clusters of each query's own C_out (never the whole
buffer), so together with faiss scanning the rest the answer is exactly IVF at that nprobe.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch

from telerag.retrieval import ivf, kernels
from telerag.retrieval.cache import Segment
from telerag.retrieval.codecs import Codec
from telerag.retrieval.shards import FAISS_PAD_SCORE

SCAN_CHUNK_BYTES = 256 << 20  # bound on the gathered rows held at once

Part = tuple[torch.Tensor, torch.Tensor]  # one half's per-query top-k (scores, ids)


def _segment_table(resident: Mapping[int, Sequence[Segment]], clusters: Sequence[int]) -> np.ndarray:
    """int64 (m, 4): buffer start, length, host start, position in `clusters` of every segment."""
    return np.array(
        [(s.start, s.length, s.host_start, pos) for pos, c in enumerate(clusters) for s in resident[c]], dtype=np.int64
    ).reshape(-1, 4)


def _expand(table: np.ndarray, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row of the segments, in order: buffer row, vector id, owner position. Built on the
    device from the segment bounds (a few small copies, not one per row)."""
    total = int(table[:, 1].sum())
    first = np.concatenate(([0], np.cumsum(table[:-1, 1])))
    bounds = torch.from_numpy(np.stack([table[:, 0] - first, table[:, 2] - first, table[:, 3], table[:, 1]]))
    bounds = bounds.to(device, non_blocking=True)
    within = torch.arange(total, device=device)
    rows = torch.repeat_interleave(bounds[0], bounds[3], output_size=total) + within
    ids = torch.repeat_interleave(bounds[1], bounds[3], output_size=total) + within
    owner = torch.repeat_interleave(bounds[2], bounds[3], output_size=total)
    return rows, ids, owner


class _ColumnIds:
    """Vector ids of the kernel's output columns, computed only for the columns asked for
    (the top k), not materialised for every scanned row."""

    def __init__(self, table: np.ndarray, device: torch.device) -> None:
        starts = np.concatenate(([0], np.cumsum(table[:, 1])[:-1]))
        bounds = torch.from_numpy(np.stack([starts, table[:, 2]])).to(device, non_blocking=True)
        self.column_starts, self.host_starts = bounds[0].contiguous(), bounds[1]

    def gather(self, columns: torch.Tensor) -> torch.Tensor:
        segment = torch.searchsorted(self.column_starts, columns, right=True) - 1
        return self.host_starts[segment] + (columns - self.column_starts[segment])


def _topk_padded(scores: torch.Tensor, ids: torch.Tensor | _ColumnIds, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-wise top-k of (scores, ids) with -inf / -1 padding when a row has fewer than k.
    `ids` is a tensor shaped like `scores`, or a `_ColumnIds` mapping columns to ids."""
    n, width = scores.shape
    if width < k:
        scores = torch.cat([scores, scores.new_full((n, k - width), float("-inf"))], dim=1)
    top = torch.topk(scores, k, dim=1).indices
    scores = scores.gather(1, top)
    if isinstance(ids, _ColumnIds):
        picked = ids.gather(top.clamp(max=max(width - 1, 0))) if width else torch.full_like(top, -1)
    else:
        if width < k:
            ids = torch.cat([ids, ids.new_full((n, k - width), -1)], dim=1)
        picked = ids.gather(1, top)
    return scores, torch.where(torch.isinf(scores), torch.full_like(picked, -1), picked)


def _top_segments_host(
    codes: np.ndarray,
    decode: Callable[[np.ndarray], np.ndarray],
    queries: np.ndarray,
    member: np.ndarray,
    table: np.ndarray,
    k: int,
) -> tuple[np.ndarray, np.ndarray]:
    """Each query's top-k (scores, columns) over the rows of the segments of `codes` whose
    cluster it probes, scored by faiss's SIMD inner products (`fvec_inner_products_ny`, its IVF
    scan's kind, so the scores are as faiss computes them). `table` is int64 (segments, 3): start in
    `codes`, length, cluster position in `member` ((n, clusters), 0/1); a column numbers the
    segments' rows in table order. `decode` turns codes that are not float32 into float32.
    Scores descend, padded with -inf / -1. List-major: a segment is read from memory once and
    stays in the CPU's cache for every query of the batch that probes it (faiss goes query by query).
    """
    n, dim = queries.shape
    queries = np.ascontiguousarray(queries, dtype=np.float32)
    positions, probing = np.nonzero(member.T)
    probers = np.split(probing, np.searchsorted(positions, np.arange(1, member.shape[1])))
    per_position = np.bincount(table[:, 2], weights=table[:, 1], minlength=member.shape[1])
    scores = [np.empty(int(width), dtype=np.float32) for width in member.astype(np.int64) @ per_position.astype(np.int64)]
    filled = [0] * n
    placed: list[list[tuple[int, int]]] = [[] for _ in range(n)]  # per query: (where in its scores, column)
    query_ptrs = [ivf.faiss.swig_ptr(query) for query in queries]
    column = 0
    for start, length, position in table.tolist():
        if length and len(probers[position]):
            segment = codes[start : start + length]
            segment = np.ascontiguousarray(segment if segment.dtype == np.float32 else decode(segment))
            rows = ivf.faiss.swig_ptr(segment)
            for query in probers[position].tolist():
                at = filled[query]
                ivf.faiss.fvec_inner_products_ny(ivf.faiss.swig_ptr(scores[query][at:]), query_ptrs[query], rows, dim, length)
                placed[query].append((at, column))
                filled[query] = at + length
        column += length
    top_scores = np.full((n, k), -np.inf, dtype=np.float32)
    top_columns = np.full((n, k), -1, dtype=np.int64)
    for query, own in enumerate(scores):
        if not len(own):
            continue
        picked = torch.topk(torch.from_numpy(own), min(k, len(own))).indices.numpy()  # descending
        starts, columns = np.array(placed[query], dtype=np.int64).T
        segment_of = np.searchsorted(starts, picked, side="right") - 1
        top_scores[query, : len(picked)] = own[picked]
        top_columns[query, : len(picked)] = columns[segment_of] + picked - starts[segment_of]
    return top_scores, top_columns


def scan_resident(
    buffer: torch.Tensor,
    queries: torch.Tensor,
    resident: Mapping[int, Sequence[Segment]],
    probes: Sequence[Sequence[int]],
    k: int,
    *,
    codec: Codec = Codec.FP32,
    codec_params: torch.Tensor | None = None,
    use_kernel: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k (scores, ids) of each query over the resident clusters it probes; -inf / -1 padded.
    The buffer holds `codec`'s codes (decoded with `codec_params` where the codec has them).

    The union of the batch's probed clusters is read once, against all the queries; a score
    counts only for the queries that probe that row's cluster. The rows are scored in place: on
    CUDA by a Triton kernel, on the CPU by faiss's inner products (`_top_segments_host`), unless
    `use_kernel` is false (`telerag bench kernels` compares the two); otherwise they are gathered
    in chunks and multiplied.
    """
    n, dim = queries.shape
    union = sorted({c for query_probes in probes for c in query_probes})
    if not union:
        return _topk_padded(
            torch.empty((n, 0), device=buffer.device), torch.empty((n, 0), dtype=torch.int64, device=buffer.device), k
        )
    position = {c: i for i, c in enumerate(union)}
    membership = np.zeros((n, len(union)), dtype=np.uint8)
    for i, query_probes in enumerate(probes):
        membership[i, [position[c] for c in query_probes]] = 1
    member = torch.from_numpy(membership).to(buffer.device, non_blocking=True)
    table = _segment_table(resident, union)
    if use_kernel and kernels.available(buffer.device):
        scores = kernels.score_segments(buffer, queries, member, table[:, [0, 1, 3]], sq8_params=codec_params)
        return _topk_padded(scores, _ColumnIds(table, buffer.device), k)
    if use_kernel and buffer.device.type == "cpu":
        top, columns = _top_segments_host(
            buffer.numpy(),
            lambda codes: codec.decode(torch.from_numpy(codes), codec_params).numpy(),
            queries.numpy(),
            membership,
            table[:, [0, 1, 3]],
            k,
        )
        found = torch.from_numpy(columns)
        ids = _ColumnIds(table, buffer.device).gather(found.clamp(min=0))
        return torch.from_numpy(top), torch.where(found >= 0, ids, found)
    rows, ids, owner = _expand(table, buffer.device)
    best_scores, best_ids = _topk_padded(
        torch.empty((n, 0), device=buffer.device), torch.empty((n, 0), dtype=torch.int64, device=buffer.device), k
    )
    chunk_rows = max(1, SCAN_CHUNK_BYTES // (dim * 4))
    minus_inf = torch.tensor(float("-inf"), device=buffer.device)
    for start in range(0, len(rows), chunk_rows):
        block = codec.decode(buffer.index_select(0, rows[start : start + chunk_rows]), codec_params)
        scores = torch.where(member[:, owner[start : start + chunk_rows]].bool(), queries @ block.T, minus_inf)
        best_scores, best_ids = _topk_padded(
            torch.cat([best_scores, scores], dim=1),
            torch.cat([best_ids, ids[start : start + chunk_rows].expand(n, -1)], dim=1),
            k,
        )
    return best_scores, best_ids


def merge_topk(parts: Sequence[Part], k: int) -> Part:
    """Merge per-query top-k lists where they lie (the device): score descending, ties broken
    by id ascending, padded like faiss. The lists come from disjoint clusters, so no id repeats."""
    scores = torch.cat([p[0] for p in parts], dim=1).float()
    ids = torch.cat([p[1] for p in parts], dim=1)
    scores = torch.where(ids < 0, float("-inf"), scores)
    by_id = torch.argsort(ids, dim=1, stable=True)  # then a stable sort by score keeps id order on ties
    scores, ids = scores.gather(1, by_id), ids.gather(1, by_id)
    order = torch.argsort(scores, dim=1, descending=True, stable=True)[:, :k]
    scores, ids = scores.gather(1, order), ids.gather(1, order)
    return torch.where(ids < 0, float(FAISS_PAD_SCORE), scores), ids


def faiss_part(part: tuple[np.ndarray, np.ndarray], device: torch.device | str) -> Part:
    """A (scores, ids) result from faiss on `device` (a view on the CPU, a small copy elsewhere)."""
    return tuple(torch.from_numpy(a).to(device, non_blocking=True) for a in part)  # type: ignore[return-value]


def merge_to_host(parts: Sequence[Part], k: int) -> tuple[np.ndarray, np.ndarray]:
    """The parts' merged top-k (see `merge_topk`), read to the host."""
    scores, ids = merge_topk(parts, k)
    return scores.cpu().numpy(), ids.cpu().numpy()
