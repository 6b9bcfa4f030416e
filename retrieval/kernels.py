"""A Triton kernel for the device half of the search: score the rows of the probed resident
clusters in place (no gather), against every query of the batch at once.

Each program takes one block of up to BLOCK_N rows of one cluster segment, reads it once, and
writes its scores for every query of the batch: the real inner product where the query probes
that cluster, -inf where it does not. Accumulation is plain fp32 (`input_precision="ieee"`),
never TF32, so the scores are those faiss computes up to summation order.

Used on CUDA when Triton is importable; `scan_resident`'s torch path is the fallback (the CPU
scores with faiss's inner products). Tests run it on the CPU through Triton's interpreter (TRITON_INTERPRET=1).
"""

from __future__ import annotations

import os

import numpy as np
import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton ships with CUDA builds of torch
    triton = None

BLOCK_N = 128  # measured best on an H100 (`telerag bench kernels`): ~1 TB/s on 786 MB of fp32 rows
BLOCK_D = 64


def available(device: torch.device) -> bool:
    if triton is None:
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


if triton is not None:
    # sizes change every call: specialising on them would recompile mid-traffic
    @triton.jit(do_not_specialize=["n_queries", "n_union", "total"])
    def _score_blocks(
        buffer_ptr,
        queries_ptr,
        member_ptr,
        table_ptr,
        out_ptr,
        sq8_ptr,
        n_queries,
        n_union,
        total,
        dim,
        BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_B: tl.constexpr,
        IS_SQ8: tl.constexpr,
    ):
        block = tl.program_id(0)
        row0 = tl.load(table_ptr + block * 4 + 0)
        n_valid = tl.load(table_ptr + block * 4 + 1)
        out0 = tl.load(table_ptr + block * 4 + 2)
        owner = tl.load(table_ptr + block * 4 + 3)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        offs_b = tl.arange(0, BLOCK_B)
        valid_n = offs_n < n_valid
        for b0 in range(0, n_queries, BLOCK_B):
            queries_b = b0 + offs_b
            valid_b = queries_b < n_queries
            acc = tl.zeros((BLOCK_N, BLOCK_B), dtype=tl.float32)
            for d0 in range(0, dim, BLOCK_D):
                valid_d = (d0 + offs_d) < dim
                x = tl.load(
                    buffer_ptr + (row0 + offs_n)[:, None].to(tl.int64) * dim + (d0 + offs_d)[None, :],
                    mask=valid_n[:, None] & valid_d[None, :],
                    other=0,
                ).to(tl.float32)
                if IS_SQ8:  # faiss's QT_8bit decode: vmin + (code + 0.5) / 255 * vdiff
                    vmin = tl.load(sq8_ptr + d0 + offs_d, mask=valid_d, other=0.0)
                    vdiff = tl.load(sq8_ptr + dim + d0 + offs_d, mask=valid_d, other=0.0)
                    x = vmin[None, :] + (x + 0.5) / 255.0 * vdiff[None, :]
                q = tl.load(
                    queries_ptr + queries_b[None, :] * dim + (d0 + offs_d)[:, None],
                    mask=valid_b[None, :] & valid_d[:, None],
                    other=0.0,
                )
                acc += tl.dot(x, q, input_precision="ieee")
            member = tl.load(member_ptr + queries_b * n_union + owner, mask=valid_b, other=0)
            scores = tl.where((member != 0)[None, :], acc, float("-inf"))
            tl.store(
                out_ptr + queries_b[None, :].to(tl.int64) * total + (out0 + offs_n)[:, None],
                scores,
                mask=valid_n[:, None] & valid_b[None, :],
            )


def score_segments(
    buffer: torch.Tensor,
    queries: torch.Tensor,
    member: torch.Tensor,
    segments: np.ndarray,
    *,
    block_n: int = BLOCK_N,
    block_d: int = BLOCK_D,
    num_warps: int = 4,
    num_stages: int = 3,
    sq8_params: torch.Tensor | None = None,
) -> torch.Tensor:
    """Scores (n_queries, total rows) of the given segments.

    `segments` is int64 (m, 3): buffer start, length, owner (column of `member`, which is
    (n_queries, n_union) uint8); output columns follow the segments in order. `sq8_params`
    (float32 (2, dim): vmin, vdiff) when the buffer holds sq8 codes.
    """
    lengths = segments[:, 1]
    total = int(lengths.sum())
    blocks_per = (lengths + block_n - 1) // block_n
    seg_of_block = np.repeat(np.arange(len(segments)), blocks_per)
    first_block = np.concatenate(([0], np.cumsum(blocks_per)[:-1]))
    within = (np.arange(len(seg_of_block)) - first_block[seg_of_block]) * block_n
    out_start = np.concatenate(([0], np.cumsum(lengths)[:-1]))
    table = np.stack(
        [
            segments[seg_of_block, 0] + within,
            np.minimum(block_n, lengths[seg_of_block] - within),
            out_start[seg_of_block] + within,
            segments[seg_of_block, 2],
        ],
        axis=1,
    ).astype(np.int64)
    n_queries, dim = queries.shape
    out = torch.empty((n_queries, total), dtype=torch.float32, device=buffer.device)
    if not len(table):
        return out
    block_b = min(64, max(16, triton.next_power_of_2(n_queries)))
    _score_blocks[(len(table),)](
        buffer,
        queries.contiguous(),
        member.contiguous(),
        torch.from_numpy(table).to(buffer.device),
        out,
        sq8_params.contiguous() if sq8_params is not None else out,  # unread unless IS_SQ8
        n_queries,
        member.shape[1],
        total,
        dim,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        BLOCK_B=block_b,
        IS_SQ8=sq8_params is not None,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out
