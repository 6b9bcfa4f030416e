"""How cluster vectors are stored: the same codes live on disk, in faiss, and in the device cache,
so the CPU (faiss) and device halves of a search score exactly the same numbers."""

from __future__ import annotations

from enum import Enum

import faiss
import numpy as np
import torch


class Codec(str, Enum):
    FP32 = "fp32"
    FP16 = "fp16"

    @property
    def numpy_dtype(self) -> np.dtype:
        return np.dtype(np.float32 if self is Codec.FP32 else np.float16)

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch.float32 if self is Codec.FP32 else torch.float16

    def vector_bytes(self, dim: int) -> int:
        return dim * self.numpy_dtype.itemsize

    def to_codes(self, vectors: np.ndarray) -> np.ndarray:
        """float32 vectors -> codes (fp16 rounds to nearest even, as faiss's own encoder does)."""
        return np.ascontiguousarray(vectors, dtype=self.numpy_dtype)

    def empty_faiss_index(self, centroids: np.ndarray) -> tuple[faiss.IndexIVF, faiss.IndexFlatIP]:
        """An inner-product IVF index over `centroids` whose inverted lists hold this codec's codes,
        and its quantizer (the caller keeps it alive: faiss does not own it)."""
        nlist, dim = centroids.shape
        quantizer = faiss.IndexFlatIP(dim)
        quantizer.add(np.ascontiguousarray(centroids, dtype=np.float32))
        if self is Codec.FP32:
            index: faiss.IndexIVF = faiss.IndexIVFFlat(quantizer, dim, nlist, faiss.METRIC_INNER_PRODUCT)
        else:
            index = faiss.IndexIVFScalarQuantizer(
                quantizer, dim, nlist, faiss.ScalarQuantizer.QT_fp16, faiss.METRIC_INNER_PRODUCT, False
            )
        index.is_trained = True
        index.own_fields = False
        return index, quantizer
