"""faiss's IVF over a datastore: the coarse quantizer, the CPU half of cooperative search,
and the reference every other search must equal."""

from __future__ import annotations

import faiss
import numpy as np

from retrieval.datastore import Datastore
from retrieval.errors import SearchError

FAISS_PAD_SCORE = -np.finfo(np.float32).max  # what faiss puts beside a -1 label for inner product


class CPUIndex:
    """An inner-product `IndexIVF` holding the datastore's own codes, list by list."""

    def __init__(self, datastore: Datastore) -> None:
        self.datastore = datastore
        self.nlist = datastore.nlist
        self.index, self.quantizer = datastore.codec.empty_faiss_index(datastore.centroids)
        offsets = datastore.offsets
        for cluster in range(self.nlist):
            start, end = int(offsets[cluster]), int(offsets[cluster + 1])
            if end == start:
                continue
            ids = np.arange(start, end, dtype=np.int64)
            codes = np.ascontiguousarray(datastore.vectors[start:end]).view(np.uint8)
            self.index.invlists.add_entries(cluster, end - start, faiss.swig_ptr(ids), faiss.swig_ptr(codes))
        self.index.ntotal = datastore.n_vectors

    def check(self, queries: np.ndarray, k: int, nprobe: int) -> np.ndarray:
        """Validate a search's arguments; returns the queries as contiguous float32."""
        queries = np.ascontiguousarray(queries, dtype=np.float32)
        if queries.ndim != 2 or queries.shape[1] != self.datastore.dim:
            raise SearchError(f"queries must have shape (n, {self.datastore.dim}), got {queries.shape}")
        if not 1 <= nprobe <= self.nlist:
            raise SearchError(f"nprobe must be between 1 and nlist ({self.nlist}), got {nprobe}")
        if k < 1:
            raise SearchError(f"k must be positive, got {k}")
        return queries

    def probe(self, queries: np.ndarray, nprobe: int) -> tuple[np.ndarray, np.ndarray]:
        """C_out: each query's `nprobe` nearest lists (scores, list ids), as faiss's own search picks them."""
        return self.quantizer.search(queries, nprobe)

    def search(self, queries: np.ndarray, k: int, nprobe: int) -> tuple[np.ndarray, np.ndarray]:
        """Plain faiss `IndexIVF.search` (the paper's baseline, and our reference)."""
        queries = self.check(queries, k, nprobe)
        return self.index.search(queries, k, params=faiss.SearchParametersIVF(nprobe=nprobe))

    def search_lists(
        self, queries: np.ndarray, k: int, lists: np.ndarray, list_scores: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """Scan only the given lists per query (-1 entries are skipped): faiss `search_preassigned`."""
        n, width = lists.shape
        lists = np.ascontiguousarray(lists, dtype=np.int64)
        list_scores = np.ascontiguousarray(list_scores, dtype=np.float32)
        scores = np.empty((n, k), dtype=np.float32)
        ids = np.empty((n, k), dtype=np.int64)
        params = faiss.SearchParametersIVF(nprobe=width)
        # The Python wrapper takes no params (so no per-call nprobe); call the C++ method directly.
        self.index.search_preassigned_c(
            n,
            faiss.swig_ptr(queries),
            k,
            faiss.swig_ptr(lists),
            faiss.swig_ptr(list_scores),
            faiss.swig_ptr(scores),
            faiss.swig_ptr(ids),
            False,
            params,
        )
        return scores, ids
