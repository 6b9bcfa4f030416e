"""`telerag bench kernels` (CUDA only; its scans are checked on the CPU in test_triton_kernel.py):
refused without CUDA, and its report, fastest variant first, failed ones counted apart."""

from __future__ import annotations

import json

import pytest
import torch

from telerag.benchmarks.kernels import KernelSweep, Variant, format_table
from telerag.cli.main import main


@pytest.mark.skipif(torch.cuda.is_available(), reason="refused only where there is no CUDA")
def test_the_command_needs_cuda():
    with pytest.raises(SystemExit, match="CUDA"):
        main(["bench", "kernels"])


def test_the_report_puts_the_fastest_variant_first_and_counts_failures():
    sweep = KernelSweep(
        bytes=786_000_000,
        torch_scan_ms=2.3,
        kernel_scan_ms=0.9,
        variants=[
            Variant(128, 64, 4, 3, ms=0.8, gbps=982.5, rel_err=1e-7),
            Variant(64, 64, 4, 3, ms=1.1, gbps=714.5, rel_err=1e-7),
            Variant(128, 128, 8, 4, error="out of resources"),
        ],
    )
    table = format_table(sweep)
    assert table.splitlines()[1].split()[:4] == ["128", "64", "4", "3"]
    assert "2 variants ran, 1 failed; 786 MB probed" in table
    assert "torch 2.300 ms, kernel 0.900 ms" in table
    report = json.loads(json.dumps(sweep.to_dict()))
    assert report["best"]["block_n"] == 128 and report["best"]["ms"] == 0.8
    assert len(report["variants"]) == 3 and report["variants"][-1]["error"] == "out of resources"
