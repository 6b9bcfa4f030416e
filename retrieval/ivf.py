"""faiss's IVF over a datastore: the coarse quantizer, the CPU half of cooperative search,
and the reference every other search must equal."""

from __future__ import annotations

import faiss
import numpy as np
from tqdm.auto import tqdm

from retrieval.datastore import Datastore
from retrieval.errors import SearchError

FAISS_PAD_SCORE = -np.finfo(np.float32).max  # what faiss puts beside a -1 label for inner product


class CPUIndex:
    """An inner-product `IndexIVF` holding the datastore's own codes, list by list."""

    def __init__(self, datastore: Datastore, *, progress: bool = False) -> None:
        """Copies every list into faiss (it reads the datastore once: minutes for tens of GB;
        `progress` shows a bar)."""
        self.datastore = datastore
        self.nlist = datastore.nlist
        self.index, self.quantizer = datastore.codec.empty_faiss_index(datastore.centroids, datastore.codec_params)
        offsets = datastore.offsets
        for cluster in tqdm(range(self.nlist), desc="load IVF lists into faiss", unit="list", disable=not progress):
            start, end = int(offsets[cluster]), int(offsets[cluster + 1])
            if end == start:
                continue
            ids = np.arange(start, end, dtype=np.int64)
            codes = np.ascontiguousarray(datastore.vectors[start:end]).view(np.uint8)
            self.index.invlists.add_entries(cluster, end - start, faiss.swig_ptr(ids), faiss.swig_ptr(codes))
        self.index.ntotal = datastore.n_vectors
        # How faiss spreads one call over its threads is a property of the index object, so
        # twins that share these lists carry the other settings: `search` parallelises over
        # query slices itself, but `search_preassigned` only does when told to (mode 3), and a
        # batch smaller than the thread count is better split over its lists (mode 1).
        self._twins = [self._twin(mode) for mode in (1, 3)]

    def _twin(self, parallel_mode: int) -> faiss.IndexIVF:
        twin, quantizer = self.datastore.codec.empty_faiss_index(self.datastore.centroids, self.datastore.codec_params)
        twin.replace_invlists(self.index.invlists, False)
        twin.ntotal = self.index.ntotal
        twin.parallel_mode = parallel_mode
        twin.__dict__["_quantizer"] = quantizer  # faiss does not own it; keep it alive with the twin
        return twin

    def _for_batch(self, n: int, *, preassigned: bool) -> faiss.IndexIVF:
        if n < faiss.omp_get_max_threads():
            return self._twins[0]
        return self._twins[1] if preassigned else self.index

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

    def search(
        self, queries: np.ndarray, k: int, nprobe: int, *, tuned: bool = True
    ) -> tuple[np.ndarray, np.ndarray]:
        """faiss `IndexIVF.search`: our reference. `tuned=False` is faiss with its default
        parallelism (over queries only), the paper's CPU baseline."""
        queries = self.check(queries, k, nprobe)
        index = self._for_batch(len(queries), preassigned=False) if tuned else self.index
        return index.search(queries, k, params=faiss.SearchParametersIVF(nprobe=nprobe))

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
        self._for_batch(n, preassigned=True).search_preassigned_c(
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


def same_results(
    ids: np.ndarray, scores: np.ndarray, ref_ids: np.ndarray, ref_scores: np.ndarray, tol: float = 1e-6
) -> bool:
    """Whether one query's top-k equals the reference's: the same ids in the same order, except
    that neighbours whose scores differ by less than `tol` (relative to the score) may swap, and
    among candidates tied at the k-th place any may be kept (faiss itself picks by scan order)."""
    if ids.shape != ref_ids.shape:
        return False
    slack = tol * np.maximum(1.0, np.abs(ref_scores))
    valid = ref_ids >= 0
    if not np.array_equal(valid, ids >= 0) or np.any(np.abs(scores[valid] - ref_scores[valid]) > slack[valid]):
        return False
    # runs of near-equal reference scores: inside a run ids may permute; the last run may differ
    k = int(valid.sum())
    run_start = 0
    for i in range(1, k + 1):
        if i == k or abs(ref_scores[i] - ref_scores[i - 1]) > slack[i]:
            if i < k and set(ids[run_start:i].tolist()) != set(ref_ids[run_start:i].tolist()):
                return False
            run_start = i
    return len(set(ids[:k].tolist())) == k
