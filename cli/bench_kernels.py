"""`telerag bench kernels`: the Triton scan kernel's variants against the torch path on CUDA (see
`benchmarks.kernels`)."""

from __future__ import annotations

import argparse
import json


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("kernels", help="the device scan on CUDA: Triton kernel variants vs. the torch path")
    parser.add_argument("--rows-per-cluster", type=int, default=1000)
    parser.add_argument("--clusters", type=int, default=256, help="clusters every query probes")
    parser.add_argument("--buffer-clusters", type=int, default=800, help="clusters in the device buffer")
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--batch", type=int, default=1, help="queries per scan")
    parser.add_argument("--dtype", choices=["fp32", "fp16"], default="fp32")
    parser.add_argument("--json", action="store_true", help="print one JSON line last")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from telerag.benchmarks.kernels import KernelSweepConfig, format_table, run_kernel_sweep

    if not torch.cuda.is_available():
        raise SystemExit("bench kernels times the Triton kernel on CUDA, and there is no CUDA device here")
    sweep = run_kernel_sweep(
        KernelSweepConfig(
            rows_per_cluster=args.rows_per_cluster,
            clusters=args.clusters,
            buffer_clusters=args.buffer_clusters,
            dim=args.dim,
            batch=args.batch,
            dtype=args.dtype,
        )
    )
    print(format_table(sweep))
    if args.json:
        print(json.dumps(sweep.to_dict()))
    return 0
