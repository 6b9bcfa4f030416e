"""The Triton scan kernel keeps faiss parity: compiled where there is CUDA, elsewhere through Triton's
CPU interpreter (some Triton releases' interpreters fail with newer numpy, as 3.6 did with numpy 2.5 on
the lent H100 image; the compiled kernel is what serves there)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

SCRIPT = """
import sys, numpy as np
from pathlib import Path
from telerag.retrieval import kernels
from telerag.retrieval.codecs import Codec
from telerag.retrieval.engine import RetrievalEngine
from telerag.retrieval.ivf import same_results
from tests.retrieval_helpers import random_datastore, random_queries, stored_vectors
import torch
tmp, device = Path(sys.argv[1]), torch.device(sys.argv[2])
assert kernels.available(device)
for codec in Codec:
    ds = random_datastore(tmp / codec.value, n=1200, dim=24, nlist=12, codec=codec, duplicates=5, empty_lists=2)
    engine = RetrievalEngine(ds, device=device, cache_bytes=ds.n_vectors * ds.dim * 4)
    q = np.concatenate([random_queries(5, ds.dim), stored_vectors(ds, [0, 1])])
    for budget in (ds.n_vectors * ds.dim, ds.n_vectors * ds.dim * 4):
        handle = engine.prefetch(q, budget)
        for nprobe, k in ((1, 5), (4, 70), (ds.nlist, 10)):
            ref_scores, ref_ids = engine.index.search(q, k, nprobe)
            result = engine.search(q, k, nprobe, prefetch=handle)
            assert sum(s.clusters_device for s in result.per_query) > 0
            for i in range(len(q)):
                assert same_results(result.ids[i], result.scores[i], ref_ids[i], ref_scores[i]), (codec, nprobe, k, i)
        handle.release()

# the torch path, asked for by name, scores what the kernel scores
from telerag.retrieval.cache import Segment
from telerag.retrieval.search import scan_resident
torch.manual_seed(0)
buffer = torch.randn(12 * 10, 24).to(device)
resident = {c: [Segment(c * 10, 10, 100 + c * 10)] for c in (1, 4, 5, 9)}
queries, probes = torch.randn(3, 24).to(device), [[1, 4], [5, 9, 1], [9]]
kernel_scores, kernel_ids = scan_resident(buffer, queries, resident, probes, 7)
torch_scores, torch_ids = scan_resident(buffer, queries, resident, probes, 7, use_kernel=False)
assert torch.equal(kernel_ids, torch_ids) and torch.allclose(kernel_scores, torch_scores, atol=1e-5)
print("ok")
"""


def test_triton_scan_matches_faiss(tmp_path: Path) -> None:
    root = Path(__file__).resolve().parents[1]
    path = os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))  # keep packages found there
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    env = {**os.environ, "PYTHONPATH": path, **({"TRITON_INTERPRET": "1"} if device == "cpu" else {})}
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path), device],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.strip().endswith("ok")
