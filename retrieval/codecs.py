"""How cluster vectors are stored: the same codes live on disk, in faiss, and in the device cache,
so the CPU (faiss) and device halves of a search score exactly the same numbers.

fp32 and fp16 are plain floats. sq8 is faiss's 8-bit scalar quantizer (`QT_8bit`): one byte per
dimension, a quarter of fp32's bytes per copy, decoded as `vmin + (code + 0.5) / 255 * vdiff`
with per-dimension `vmin`, `vdiff` trained on the data (the codec's parameters, kept beside the
vectors in the datastore).
"""

from __future__ import annotations

from enum import StrEnum
from typing import TYPE_CHECKING

import faiss
import numpy as np

from telerag.retrieval.errors import LayoutError

if TYPE_CHECKING:
    import torch

SQ8_TRAIN_SAMPLE = 1 << 18  # vectors the 8-bit quantizer's ranges are trained on


class Codec(StrEnum):
    FP32 = "fp32"
    FP16 = "fp16"
    SQ8 = "sq8"

    @property
    def numpy_dtype(self) -> np.dtype:
        return np.dtype({Codec.FP32: np.float32, Codec.FP16: np.float16, Codec.SQ8: np.uint8}[self])

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch  # here, not at the top: the server reads manifests (their codec) before torch loads

        return {Codec.FP32: torch.float32, Codec.FP16: torch.float16, Codec.SQ8: torch.uint8}[self]

    @property
    def has_params(self) -> bool:
        return self is Codec.SQ8

    def train(self, vectors: np.ndarray, seed: int = 0) -> np.ndarray | None:
        """The codec's parameters for these vectors: float32 (2, dim) `vmin`, `vdiff` for sq8
        (faiss's own training, min/max per dimension), None for the float codecs."""
        if not self.has_params:
            return None
        vectors = np.ascontiguousarray(vectors, dtype=np.float32)
        if len(vectors) > SQ8_TRAIN_SAMPLE:
            rows = np.random.default_rng(seed).choice(len(vectors), SQ8_TRAIN_SAMPLE, replace=False)
            vectors = np.ascontiguousarray(vectors[np.sort(rows)])
        quantizer = faiss.ScalarQuantizer(vectors.shape[1], faiss.ScalarQuantizer.QT_8bit)
        quantizer.train(vectors)
        return faiss.vector_to_array(quantizer.trained).astype(np.float32).reshape(2, -1)

    def to_codes(self, vectors: np.ndarray, params: np.ndarray | None = None) -> np.ndarray:
        """float32 vectors -> codes, by faiss's own encoder (so a vector a live datastore adds is
        coded as faiss's `add_with_ids` codes it: its fp16 rounds halfway cases away from zero,
        where numpy's rounds them to even; sq8 needs the parameters from `train`)."""
        vectors = np.ascontiguousarray(vectors, dtype=np.float32)
        if self is Codec.FP32:
            return vectors
        if self is Codec.FP16:
            quantizer = faiss.ScalarQuantizer(vectors.shape[1], faiss.ScalarQuantizer.QT_fp16)
            return quantizer.compute_codes(vectors).view(np.float16).reshape(vectors.shape)
        return self._sq8(self._checked(params, vectors.shape[1])).compute_codes(vectors)

    def decode(self, codes: torch.Tensor, params: torch.Tensor | None = None) -> torch.Tensor:
        """Codes (rows of the device cache) -> float32, as faiss decodes them."""
        if not self.has_params:
            return codes.float()
        assert params is not None, "sq8 codes need the codec's parameters"
        return params[0] + (codes.float() + 0.5) / 255.0 * params[1]

    def decode_exact(self, codes: np.ndarray, params: np.ndarray | None = None) -> np.ndarray:
        """Codes -> float64, the decoding's exact value (faiss's float32 decoding of sq8 may
        differ from it by up to `decode_slack`; the float codecs convert exactly)."""
        if not self.has_params:
            return np.asarray(codes, dtype=np.float64)
        params64 = self._checked(params, np.shape(codes)[-1]).astype(np.float64)
        return params64[0] + (np.asarray(codes, dtype=np.float64) + 0.5) / 255.0 * params64[1]

    def decode_slack(self, params: np.ndarray | None = None, dim: int = 0) -> float:
        """How far (Euclidean norm) a vector faiss decodes in float32 may lie from
        `decode_exact`'s: none for the float codecs; for sq8 a few roundings of `vmin` and
        `vdiff`'s size per dimension (float32's unit roundoff is 2^-24; four of them, to spare)."""
        if not self.has_params:
            return 0.0
        params64 = self._checked(params, dim).astype(np.float64)
        return float(np.linalg.norm(4 * 2.0**-24 * (np.abs(params64[0]) + np.abs(params64[1]))))

    def empty_faiss_index(
        self, centroids: np.ndarray, params: np.ndarray | None = None
    ) -> tuple[faiss.IndexIVF, faiss.IndexFlatIP]:
        """An inner-product IVF index over `centroids` whose inverted lists hold this codec's codes,
        and its quantizer (the caller keeps it alive: faiss does not own it)."""
        nlist, dim = centroids.shape
        quantizer = faiss.IndexFlatIP(dim)
        quantizer.add(np.ascontiguousarray(centroids, dtype=np.float32))
        if self is Codec.FP32:
            index: faiss.IndexIVF = faiss.IndexIVFFlat(quantizer, dim, nlist, faiss.METRIC_INNER_PRODUCT)
        else:
            kind = faiss.ScalarQuantizer.QT_fp16 if self is Codec.FP16 else faiss.ScalarQuantizer.QT_8bit
            index = faiss.IndexIVFScalarQuantizer(quantizer, dim, nlist, kind, faiss.METRIC_INNER_PRODUCT, False)
            if self.has_params:
                faiss.copy_array_to_vector(self._checked(params, dim).ravel(), index.sq.trained)
        index.is_trained = True
        index.own_fields = False
        return index, quantizer

    def _checked(self, params: np.ndarray | None, dim: int) -> np.ndarray:
        if params is None or np.shape(params) != (2, dim):
            raise LayoutError(f"{self.value} needs its trained parameters, float32 (2, {dim})")
        return np.ascontiguousarray(params, dtype=np.float32)

    @staticmethod
    def _sq8(params: np.ndarray) -> faiss.ScalarQuantizer:
        quantizer = faiss.ScalarQuantizer(params.shape[1], faiss.ScalarQuantizer.QT_8bit)
        faiss.copy_array_to_vector(params.ravel(), quantizer.trained)
        return quantizer
