"""Small datastores for the retrieval tests, built in milliseconds with no models: random
vectors, or a four-topic corpus under a bag-of-words embedder; and the check that a search
equals faiss's."""

from __future__ import annotations

import json
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch

from telerag.retrieval.builder import assign_lists, build_datastore, train_centroids, write_clustered
from telerag.retrieval.codecs import Codec
from telerag.retrieval.corpus import read_jsonl, split_passages
from telerag.retrieval.datastore import Datastore
from telerag.retrieval.demand import DemandCopyPolicy
from telerag.retrieval.engine import RetrievalEngine, SearchResult
from telerag.retrieval.ivf import same_results

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def random_datastore(
    path: Path,
    *,
    n: int = 3000,
    dim: int = 16,
    nlist: int = 32,
    codec: Codec = Codec.FP32,
    seed: int = 0,
    duplicates: int = 0,
    empty_lists: int = 0,
) -> Datastore:
    """Unit vectors in `nlist` lists; `duplicates` copies of one vector make exact score ties;
    `empty_lists` extra centroids far from every vector make empty lists."""
    rng = np.random.default_rng(seed)
    vectors = rng.standard_normal((n, dim)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    if duplicates:
        vectors[1 : 1 + duplicates] = vectors[0]
    centroids = train_centroids(vectors, nlist, seed=seed)
    if empty_lists:
        far = -np.abs(rng.standard_normal((empty_lists, dim))).astype(np.float32) * 1e-3
        centroids = np.concatenate([centroids, far])
    lists = assign_lists(vectors, centroids)
    write_clustered(path, vectors=vectors, lists=lists, centroids=centroids, codec=codec, embedder="random")
    return Datastore.load(path)


def random_queries(n: int, dim: int, seed: int = 1) -> np.ndarray:
    q = np.random.default_rng(seed).standard_normal((n, dim)).astype(np.float32)
    return q / np.linalg.norm(q, axis=1, keepdims=True)


def stored_vectors(ds: Datastore, rows: list[int]) -> np.ndarray:
    """The vectors as the datastore holds them (decoded from its codec), as float32 queries."""
    params = None if ds.codec_params is None else torch.from_numpy(ds.codec_params)
    return ds.codec.decode(torch.from_numpy(np.asarray(ds.vectors[rows])), params).numpy()


class CopyEveryMiss(DemandCopyPolicy):
    """Copies are free and faiss is slow, whatever is measured: every miss that fits is copied
    (the measured rates depend on the machine's load; the tests must not)."""

    def __init__(self) -> None:
        super().__init__(copy_bytes_per_ms=1e15)
        self.cpu_bytes_per_ms = 1e-3

    def observe_copy(self, nbytes: int, ms: float) -> None:
        pass

    def observe_cpu(self, scanned_bytes: int, ms: float) -> None:
        pass


def assert_same_as_faiss(engine: RetrievalEngine, queries: np.ndarray, k: int, nprobe: int, **kwargs) -> SearchResult:
    """The engine's search (`kwargs`: its options) as faiss's own at the same nprobe."""
    ref_scores, ref_ids = engine.index.search(queries, k, nprobe)
    result = engine.search(queries, k, nprobe, **kwargs)
    assert result.ids.shape == (len(queries), k)
    for i in range(len(queries)):
        assert same_results(result.ids[i], result.scores[i], ref_ids[i], ref_scores[i]), (
            i,
            result.ids[i],
            ref_ids[i],
            result.scores[i],
            ref_scores[i],
        )
    return result


def hashing_encoder(dim: int = 16) -> Callable[[Sequence[str]], np.ndarray]:
    """A deterministic bag-of-words encoder: texts sharing words get near vectors."""

    def encode(texts):
        out = np.zeros((len(texts), dim), dtype=np.float32)
        for i, text in enumerate(texts):
            for word in text.lower().split():
                out[i, zlib.crc32(word.encode()) % dim] += 1.0
        out += 1e-3
        return out / np.linalg.norm(out, axis=1, keepdims=True)

    return encode


class HashEmbedder:
    """`hashing_encoder` as the pipelines' embedder."""

    name = "hash-32"
    dim = 32

    def __init__(self) -> None:
        self._encode = hashing_encoder(self.dim)

    def encode(self, texts, *, pause=None):
        if pause is not None:
            pause()  # its one layer
        return self._encode(list(texts))

    def count_tokens(self, texts):
        return sum(len(text.split()) for text in texts)  # its tokens are words


TOPICS = {
    "rivers": "river water fish boat delta flood bank",
    "space": "star planet orbit moon telescope galaxy comet",
    "music": "piano music song concert orchestra violin",
    "baking": "bread flour oven bake yeast dough crust",
}


def topic_datastore(root: Path, *, per_topic: int, nlist: int) -> tuple[HashEmbedder, Path]:
    """A datastore at `root`/ds of `per_topic` passages on each of the four TOPICS (ids
    `topic-i`), under a HashEmbedder; the corpus it was built from is `root`/c.jsonl."""
    lines = [json.dumps({"id": f"{t}-{i}", "title": t, "text": f"{TOPICS[t]} item{i}"}) for i in range(per_topic) for t in TOPICS]
    (root / "c.jsonl").write_text("\n".join(lines))
    embedder = HashEmbedder()
    build_datastore(
        split_passages(read_jsonl(root / "c.jsonl")),
        embedder.encode,
        embedder=embedder.name,
        out_dir=root / "ds",
        nlist=nlist,
        progress=False,
    )
    return embedder, root / "ds"


def tiny_cross_encoder(folder: Path, words: set[str]) -> Path:
    """A sentence-transformers cross-encoder in `folder`: a one-layer BERT with one output and
    random weights (a real architecture; its scores mean nothing), its vocabulary `words`."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification, BertTokenizerFast

    (folder / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *sorted(words)]) + "\n")
    tokenizer = BertTokenizerFast(vocab_file=str(folder / "vocab.txt"))
    config = BertConfig(
        vocab_size=len(tokenizer), hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=512, num_labels=1,
    )  # fmt: skip
    torch.manual_seed(0)
    BertForSequenceClassification(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
