"""On CUDA, retrieval's device work runs on its own stream: a search, and a query's embedding,
in a process whose default stream is busy with generation (here a long queue of matmuls)
complete, the search with faiss's answer, while that generation is still running. On the CPU
there are no streams (the rest of the suite runs the same code there)."""

from __future__ import annotations

import pytest
import torch

from telerag.pipelines.embedder import Embedder
from telerag.pipelines.retriever import DirectRetriever
from telerag.retrieval.engine import RetrievalEngine
from tests.retrieval_helpers import assert_same_as_faiss, random_datastore, random_queries
from tests.tiny_models import tiny_embedder_dir

GENERATION_MATMULS = 200  # fp32 8192² products: seconds of default-stream work on an H100 or RTX 4090
MATMUL_SIZE = 8192


def busy_default_stream() -> torch.cuda.Event:
    """Seconds of matmuls queued on the default stream (what the transformers engine's decode
    steps use); the event that records their end."""
    a = torch.randn(MATMUL_SIZE, MATMUL_SIZE, device="cuda")
    out = torch.empty_like(a)
    torch.cuda.synchronize()
    default = torch.cuda.default_stream()
    with torch.cuda.stream(default):
        for _ in range(GENERATION_MATMULS):
            torch.mm(a, a, out=out)
        done = torch.cuda.Event()
        done.record(default)
    return done


def test_the_cpu_engine_has_no_stream(tmp_path):
    ds = random_datastore(tmp_path / "ds", n=500, nlist=8)
    engine = RetrievalEngine(ds, device="cpu", cache_bytes=10**6)
    assert engine.stream is None and engine.cache.copy_stream is None
    engine.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_search_completes_while_generation_runs_on_the_default_stream(tmp_path):
    ds = random_datastore(tmp_path / "ds", n=20_000, dim=64, nlist=64)
    everything = ds.n_vectors * ds.dim * 4
    engine = RetrievalEngine(ds, device="cuda", cache_bytes=everything, demand_copy=False)
    warm, queries = random_queries(8, ds.dim, seed=1), random_queries(8, ds.dim, seed=2)
    handle = engine.prefetch(warm, everything // 2)  # Triton compiled, allocator warm, some clusters resident
    assert_same_as_faiss(engine, warm, 10, 16, prefetch=handle)
    torch.cuda.synchronize()

    generation_done = busy_default_stream()
    handle = engine.prefetch(queries, everything)  # ranking on the device, then copies of the rest
    result = assert_same_as_faiss(engine, queries, 10, 16, prefetch=handle)
    generation_still_running = not generation_done.query()
    generation_done.synchronize()
    assert sum(q.clusters_device for q in result.per_query) > 0  # the search did run on the device
    assert generation_still_running, "the search waited for the default stream's kernels"
    engine.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_query_is_embedded_while_generation_runs_on_the_default_stream(tmp_path):
    ds = random_datastore(tmp_path / "ds", n=2_000, dim=32, nlist=16)
    engine = RetrievalEngine(ds, device="cuda", cache_bytes=ds.n_vectors * ds.dim * 4, demand_copy=False)
    retriever = DirectRetriever(engine, Embedder(tiny_embedder_dir(32, 0), device="cuda"))
    retriever._embed(["warm up the embedder"])
    torch.cuda.synchronize()
    generation_done = busy_default_stream()
    vectors, _ = retriever._embed(["what is topic 3 about?"])
    generation_still_running = not generation_done.query()
    generation_done.synchronize()
    assert vectors.shape == (1, 32)
    assert generation_still_running, "the embedding waited for the default stream's kernels"
    engine.close()
