"""`telerag bench retrieval` on a small synthetic datastore: every search it times is exact,
and `--json` ends with one JSON object carrying the fields the README and the issue name."""

from __future__ import annotations

import gzip
import json

import pytest

from telerag.benchmarks.retrieval import BenchConfig, run
from telerag.cli.main import main
from telerag.pipelines.embedder import Embedder
from telerag.retrieval.builder import build_datastore
from telerag.retrieval.corpus import Article, split_passages
from telerag.retrieval.datastore import Datastore
from telerag.retrieval.engine import default_nprobe
from tests.tiny_models import tiny_embedder_dir

REQUIRED = {
    "device", "n_vectors", "dim", "nlist", "nprobe", "batch", "budget_bytes", "overlap_rate", "faiss_ms_p50",
    "ours_ms_p50", "resident_ms_p50", "speedup_vs_faiss", "identical_fraction", "copy_gbps", "copy_gbps_peak",
    "ours_demand_ms_p50", "demand_vs_resident", "demand_copied_fraction", "demand_bound_ms", "demand_vs_bound",
    "missed_mb_p50", "early_stop_faiss_ms_p50", "early_stop_ms_p50", "early_stop_speedup", "lists_scanned_fraction",
    "early_stop_identical_fraction",
}  # fmt: skip


@pytest.mark.parametrize("batch", [1, 3])
def test_every_timed_search_is_exact(tmp_path, batch):
    config = BenchConfig(
        vectors=4000, dim=16, nlist=32, nprobe=8, topk=5, batch=batch, queries=9, budget_mb=0.06,
        overlap_noise=0.5, device="cpu", datastore_dir=tmp_path,
    )  # fmt: skip
    result = run(config, progress=False)
    assert result.keys() >= REQUIRED
    assert result["identical_fraction"] == result["early_stop_identical_fraction"] == 1.0
    assert 0.0 < result["lists_scanned_fraction"] <= 1.0
    assert result["n_vectors"] == 4000 and result["nprobe"] == 8 and result["batch"] == batch
    assert 0.0 < result["overlap_rate"] <= 1.0
    assert result["demand_cache_bytes"] == result["cache_bytes"] == int(0.06 * (1 << 20))  # no extra room by default
    # how much the demand run copies depends on the rates it measures, i.e. on this machine's load
    assert 0.0 <= result["demand_copied_fraction"] <= 1.0
    assert result["device_cluster_fraction"] <= result["demand_device_cluster_fraction"] <= 1.0


def test_cli_json_is_the_last_line(tmp_path, capsys):
    args = ["bench", "retrieval", "--vectors", "3000", "--dim", "8", "--nlist", "16", "--nprobe", "4", "--queries", "6",
            "--budget-mb", "0.02", "--device", "cpu", "--cpu-threads", "1", "--datastore-dir", str(tmp_path),
            "--json"]  # fmt: skip
    assert main(args) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    payload = json.loads(last)
    assert payload.keys() >= REQUIRED
    assert payload["identical_fraction"] == 1.0
    assert payload["config"]["budget_mb"] == 0.02 and payload["config"]["cpu_threads"] == 1


def test_profile_dir_gets_a_trace_of_each_phase(tmp_path):
    config = BenchConfig(
        vectors=3000, dim=8, nlist=16, nprobe=4, queries=6, budget_mb=0.02, device="cpu",
        datastore_dir=tmp_path / "ds", profile_dir=tmp_path / "profile",
    )  # fmt: skip
    assert run(config, progress=False)["identical_fraction"] == 1.0
    for phase in ("ours", "ours-demand-copies", "all-resident"):
        trace = json.loads(gzip.decompress((tmp_path / "profile" / f"{phase}.json.gz").read_bytes()))
        names = {event.get("name", "") for event in trace["traceEvents"]}
        assert any("engine.py" in name and "search" in name for name in names), phase  # Python calls are traced
        assert "Self CPU" in (tmp_path / "profile" / f"{phase}.txt").read_text()


def test_a_stream_with_repeats_and_a_cache_larger_than_the_datastore_keeps_it_resident(tmp_path):
    """Popular queries repeat; with room for everything, what they read stays resident across
    requests, so later searches miss (almost) nothing; answers stay exact."""
    config = BenchConfig(
        vectors=3000, dim=8, nlist=16, nprobe=4, queries=24, distinct_queries=3, budget_mb=0.02, cache_mb=1.0,
        device="cpu", datastore_dir=tmp_path,
    )  # fmt: skip
    result = run(config, progress=False)
    assert result["identical_fraction"] == 1.0
    assert result["missed_mb_p50"] == 0.0  # the repeats find their clusters resident


@pytest.fixture(scope="module")
def configured_datastore(tmp_path_factory):
    """A small datastore with passages under the tiny embedder, as the configured one."""
    embedder = Embedder(tiny_embedder_dir(32, 0))
    articles = [Article(id=f"a{i}", title=f"A{i}", text=f"Article {i} is about topic {i % 7}. " * 12) for i in range(60)]
    out = tmp_path_factory.mktemp("configured") / "datastore"
    build_datastore(split_passages(articles), embedder.encode, embedder=embedder.name, out_dir=out, nlist=6, progress=False)
    return out


@pytest.mark.parametrize("scale_vectors", [None, 2000])
def test_the_configured_datastore_as_it_is_or_scaled_up(configured_datastore, monkeypatch, tmp_path, scale_vectors):
    """`--configured` and `--scale-vectors`: the configured datastore (or it scaled up as bench
    e2e scales it) at the server's default nprobe, early stop beside faiss, every answer exact."""
    monkeypatch.setenv("TELERAG_RETRIEVAL__DATASTORE", str(configured_datastore))
    monkeypatch.setenv("TELERAG_RETRIEVAL__EMBEDDER", str(tiny_embedder_dir(32, 0)))
    monkeypatch.setenv("TELERAG_RETRIEVAL__EMBEDDER_DEVICE", "cpu")
    config = BenchConfig(
        topk=3, queries=6, budget_mb=0.01, device="cpu", configured=scale_vectors is None, scale_vectors=scale_vectors,
        nlist=32 if scale_vectors else None, datastore_dir=tmp_path,
    )  # fmt: skip
    result = run(config, progress=False)
    base = Datastore.load(configured_datastore)
    assert result["n_vectors"] == (scale_vectors or base.n_vectors)
    assert result["nlist"] == (32 if scale_vectors else base.nlist) and result["nprobe"] == default_nprobe(result["nlist"])
    assert result["identical_fraction"] == result["early_stop_identical_fraction"] == 1.0
    assert 0.0 < result["lists_scanned_fraction"] <= 1.0
    assert not list(tmp_path.iterdir())  # no synthetic datastore was made


@pytest.mark.parametrize("codec", ["fp32", "sq8"])
def test_a_synthetic_datastore_is_made_a_block_at_a_time_and_any_slice_is_the_same(tmp_path, codec, monkeypatch):
    """The synthetic datastore is written as it is made (a datastore larger than memory is never
    held): a block's rows are the same whichever slice asks for them, and each row lies in its
    centre's list, near that centre."""
    import numpy as np

    from telerag.benchmarks import retrieval as bench

    monkeypatch.setattr(bench, "SYNTHETIC_BLOCK", 64)  # many blocks in a small datastore
    path = bench.synthetic_datastore(BenchConfig(vectors=1000, dim=16, nlist=12, codec=codec, datastore_dir=tmp_path), False)
    ds = Datastore.load(path)
    rows = bench.SyntheticRows(ds.centroids, ds.offsets, ds.codec, 0, bench.torch.device("cpu"))
    whole = rows[0:1000]
    np.testing.assert_array_equal(whole, np.asarray(ds.vectors))
    np.testing.assert_array_equal(np.concatenate([rows[a : a + 37] for a in range(0, 1000, 37)]), whole)
    floats = np.concatenate([rows._floats(b) for b in range(-(-1000 // 64))])
    owner = np.searchsorted(ds.offsets, np.arange(1000), side="right") - 1
    closest = np.argmax(floats @ ds.centroids.T, axis=1)
    assert np.mean(closest == owner) > 0.9 and np.allclose(np.linalg.norm(floats, axis=1), 1, atol=1e-5)
    ds.close()
