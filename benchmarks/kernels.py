"""Time the device scan on a GPU: Triton kernel variants vs. the torch gather path, against the
bytes they must read (each probed row once). Run on a CUDA machine:

    python scripts/kernel_sweep.py --rows-per-cluster 1000 --clusters 256 --dim 768 --batch 1
"""

from __future__ import annotations

import argparse
import itertools
import json

import numpy as np
import torch

from telerag.retrieval import kernels, search
from telerag.retrieval.cache import Segment


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows-per-cluster", type=int, default=1000)
    parser.add_argument("--clusters", type=int, default=256)
    parser.add_argument("--buffer-clusters", type=int, default=800)
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--dtype", choices=["fp32", "fp16"], default="fp32")
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    device = torch.device("cuda")
    dtype = torch.float32 if args.dtype == "fp32" else torch.float16
    rows = args.rows_per_cluster
    buffer = torch.randn(args.buffer_clusters * rows, args.dim, device=device).to(dtype)
    rng = np.random.default_rng(0)
    chosen = np.sort(rng.choice(args.buffer_clusters, args.clusters, replace=False))
    resident = {int(c): [Segment(int(c) * rows, rows, int(c) * rows)] for c in chosen}
    queries = torch.randn(args.batch, args.dim, device=device)
    probes = [chosen.tolist()] * args.batch
    nbytes = args.clusters * rows * args.dim * buffer.element_size()

    def time_it(fn) -> float:
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(20):
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            fn()
            end.record()
            end.synchronize()
            times.append(begin.elapsed_time(end))
        return float(np.median(times))

    table = search._segment_table(resident, sorted(resident))
    member = torch.ones((args.batch, len(resident)), dtype=torch.uint8, device=device)
    reference = (queries @ torch.cat([buffer[s.start : s.start + s.length] for c in sorted(resident) for s in resident[c]]).float().T)
    results = []
    for block_n, block_d, warps, stages in itertools.product([32, 64, 128], [32, 64, 128], [4, 8], [2, 3, 4]):
        fn = lambda: kernels.score_segments(  # noqa: E731
            buffer, queries, member, table[:, [0, 1, 3]], block_n=block_n, block_d=block_d, num_warps=warps, num_stages=stages
        )
        try:
            error = float(((fn() - reference).abs().max() / reference.abs().max()).item())
            ms = time_it(fn)
        except Exception as exc:  # noqa: BLE001 - a variant that does not compile is just skipped
            results.append({"variant": [block_n, block_d, warps, stages], "error": str(exc)[:80]})
            continue
        results.append({"variant": [block_n, block_d, warps, stages], "ms": ms, "gbps": nbytes / ms / 1e6, "rel_err": error})
    saved = search.kernels.available
    search.kernels.available = lambda device: False
    torch_ms = time_it(lambda: search.scan_resident(buffer, queries, resident, probes, 10))
    search.kernels.available = saved
    kernel_ms = time_it(lambda: search.scan_resident(buffer, queries, resident, probes, 10))
    ok = sorted((r for r in results if "ms" in r), key=lambda r: r["ms"])
    for r in ok[:8]:
        print(r)
    print(json.dumps({"bytes": nbytes, "torch_scan_ms": torch_ms, "kernel_scan_ms": kernel_ms, "best": ok[0] if ok else None}))


if __name__ == "__main__":
    main()
