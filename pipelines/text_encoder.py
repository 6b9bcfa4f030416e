"""What the retrieval side needs of an embedder (`TextEncoder`: `pipelines.embedder.Embedder` is
one), and the one way its output is read (`embedded`): float32 rows, one per text, whatever array
type or dtype the model returns. Light: no torch, so that the modules which only type or call an
embedder load before it."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np


class TextEncoder(Protocol):
    name: str
    dim: int

    def encode(self, texts: Sequence[str], *, pause: Callable[[], None] | None = None) -> np.ndarray:
        """`pause`: called before the model's layers with the encoder free meanwhile: how a
        write's embedding lets queries in."""
        ...

    def count_tokens(self, texts: Sequence[str]) -> int: ...


def embedded(encoder: TextEncoder, texts: Sequence[str], *, pause: Callable[[], None] | None = None) -> np.ndarray:
    """`texts` embedded by `encoder` as float32 rows (len(texts), dim)."""
    if not texts:
        return np.zeros((0, encoder.dim), np.float32)
    return np.asarray(encoder.encode(list(texts), pause=pause), dtype=np.float32).reshape(len(texts), -1)
