"""`telerag bench kernels`: the device scan on CUDA, every Triton kernel variant (block sizes,
warps, stages) against the torch gather path, over the bytes they must read (each probed row
once). The chosen defaults are `retrieval.kernels.BLOCK_N` and `BLOCK_D`.

The buffer holds `buffer_clusters` clusters of `rows_per_cluster` random rows, one after another;
every query probes the same `clusters` of them, picked at random."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np
import torch

from telerag.retrieval import kernels
from telerag.retrieval.cache import Segment
from telerag.retrieval.search import scan_resident

BLOCK_N = (32, 64, 128)
BLOCK_D = (32, 64, 128)
WARPS = (4, 8)
STAGES = (2, 3, 4)
TOP_K = 10  # of the whole-scan timings
TIMED_RUNS = 20  # after 3 unmeasured ones


@dataclass(frozen=True)
class KernelSweepConfig:
    rows_per_cluster: int = 1000
    clusters: int = 256  # probed by every query
    buffer_clusters: int = 800
    dim: int = 768
    batch: int = 1
    dtype: str = "fp32"  # or fp16


@dataclass(frozen=True)
class Variant:
    """One compiled kernel variant: its launch parameters and, unless it failed, its time."""

    block_n: int
    block_d: int
    num_warps: int
    num_stages: int
    ms: float | None = None  # median
    gbps: float | None = None  # bytes read / ms
    rel_err: float | None = None  # max |kernel - torch| / max |torch| over the scores
    error: str | None = None  # why it did not run (a variant that does not compile is skipped)


@dataclass(frozen=True)
class KernelSweep:
    bytes: int  # rows the probed clusters hold: what a scan must read
    torch_scan_ms: float  # `scan_resident` (top-k included) on the torch path
    kernel_scan_ms: float  # and with the kernel at its defaults
    variants: list[Variant]  # fastest first; failed ones last

    @property
    def best(self) -> Variant | None:
        return self.variants[0] if self.variants and self.variants[0].ms is not None else None

    def to_dict(self) -> dict:
        """The `--json` line: the totals, the best variant and every variant."""
        best = self.best
        return {
            "bytes": self.bytes,
            "torch_scan_ms": self.torch_scan_ms,
            "kernel_scan_ms": self.kernel_scan_ms,
            "best": asdict(best) if best else None,
            "variants": [asdict(v) for v in self.variants],
        }


def _median_ms(fn: Callable[[], object]) -> float:
    """Median CUDA-event time of `fn` over TIMED_RUNS runs, after three unmeasured ones."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(TIMED_RUNS):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        fn()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end))
    return float(np.median(times))


def run_kernel_sweep(config: KernelSweepConfig) -> KernelSweep:
    """Time every variant of `kernels.score_segments`, then the whole `scan_resident` with and
    without the kernel (needs CUDA)."""
    torch.backends.cuda.matmul.allow_tf32 = False  # the reference is plain fp32, as the kernel is
    device = torch.device("cuda")
    dtype = torch.float32 if config.dtype == "fp32" else torch.float16
    rows = config.rows_per_cluster
    buffer = torch.randn(config.buffer_clusters * rows, config.dim, device=device).to(dtype)
    chosen = np.sort(np.random.default_rng(0).choice(config.buffer_clusters, config.clusters, replace=False))
    resident = {int(c): [Segment(int(c) * rows, rows, int(c) * rows)] for c in chosen}
    queries = torch.randn(config.batch, config.dim, device=device)
    probes = [chosen.tolist()] * config.batch
    nbytes = config.clusters * rows * config.dim * buffer.element_size()
    # (buffer start, length, owner) of each probed cluster, every query probing every one
    segments = np.stack([chosen * rows, np.full(len(chosen), rows), np.arange(len(chosen))], axis=1).astype(np.int64)
    member = torch.ones((config.batch, len(chosen)), dtype=torch.uint8, device=device)
    reference = queries @ torch.cat([buffer[c * rows : (c + 1) * rows] for c in chosen]).float().T
    variants = []
    for block_n, block_d, warps, stages in itertools.product(BLOCK_N, BLOCK_D, WARPS, STAGES):
        score = functools.partial(
            kernels.score_segments,
            buffer, queries, member, segments, block_n=block_n, block_d=block_d, num_warps=warps, num_stages=stages,
        )  # fmt: skip
        try:
            error = float(((score() - reference).abs().max() / reference.abs().max()).item())
            ms = _median_ms(score)
        except Exception as exc:  # noqa: BLE001 - a variant that does not compile is just skipped
            variants.append(Variant(block_n, block_d, warps, stages, error=str(exc)[:80]))
            continue
        variants.append(Variant(block_n, block_d, warps, stages, ms=ms, gbps=nbytes / ms / 1e6, rel_err=error))
    torch_ms = _median_ms(lambda: scan_resident(buffer, queries, resident, probes, TOP_K, use_kernel=False))
    kernel_ms = _median_ms(lambda: scan_resident(buffer, queries, resident, probes, TOP_K))
    variants.sort(key=lambda v: (v.ms is None, v.ms or 0.0))
    return KernelSweep(bytes=nbytes, torch_scan_ms=torch_ms, kernel_scan_ms=kernel_ms, variants=variants)


def format_table(sweep: KernelSweep, rows: int = 8) -> str:
    """The `rows` fastest variants, then the whole scan both ways."""
    lines = [f"{'block_n':>8}{'block_d':>8}{'warps':>6}{'stages':>7}{'ms':>9}{'GB/s':>8}{'rel err':>10}"]
    for v in [v for v in sweep.variants if v.ms is not None][:rows]:
        lines.append(f"{v.block_n:>8}{v.block_d:>8}{v.num_warps:>6}{v.num_stages:>7}{v.ms:>9.3f}{v.gbps:>8.0f}{v.rel_err:>10.1e}")
    failed = sum(v.ms is None for v in sweep.variants)
    lines.append(f"{len(sweep.variants) - failed} variants ran, {failed} failed; {sweep.bytes / 1e6:.0f} MB probed")
    lines.append(f"scan_resident: torch {sweep.torch_scan_ms:.3f} ms, kernel {sweep.kernel_scan_ms:.3f} ms")
    return "\n".join(lines)
