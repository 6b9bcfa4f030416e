"""faiss's IVF over a datastore: the coarse quantizer, the CPU half of cooperative search,
and the reference every other search must equal."""

from __future__ import annotations

from typing import Any, Protocol

import faiss as typed_faiss
import numpy as np

from telerag.retrieval.datastore import Datastore
from telerag.retrieval.errors import LayoutError, SearchError
from telerag.retrieval.shards import ShardRows

# This module reaches below faiss's Python API, into its SWIG classes (search_preassigned_c,
# MaybeOwnedVector's fields, SearchParametersIVF's keywords), which faiss's shipped stubs do not
# declare: its calls are typed as Any here, and only here.
faiss: Any = typed_faiss


class ListSearch(Protocol):
    """The CPU half of a cooperative search: a top-k over given lists per query (-1 entries
    skipped). `CPUIndex` serves it in process, `server.ray_serve.tier.RetrievalTier` on a Ray cluster."""

    def search_lists(
        self, queries: np.ndarray, k: int, lists: np.ndarray, list_scores: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]: ...


class CPUIndex:
    """An inner-product `IndexIVF` whose inverted lists are views of the datastore's own codes,
    or of one shard's part of them (`shard`: the retrieval tier's, `retrieval.shards`); it
    answers passage ids (`Datastore.ids_of`)."""

    def __init__(self, datastore: Datastore, *, vectors: np.ndarray | None = None, shard: ShardRows | None = None) -> None:
        """`vectors`: the host memory faiss reads the codes from, laid out like the datastore's
        (default: its memory map; the engine passes its pinned copy on CUDA). faiss copies
        only the ids: the codes are never held twice in RAM, and nothing is read at start-up.
        The index keeps `vectors` alive. With `shard`, the index holds that shard's rows alone,
        copied from the datastore once (`vectors` is then the shard's own, in its order)."""
        self.datastore = datastore
        self.nlist = datastore.nlist
        offsets, rows = (datastore.offsets, None) if shard is None else (shard.offsets, shard.ids)
        if vectors is None:
            vectors = datastore.vectors if rows is None else np.ascontiguousarray(datastore.vectors[rows])
        self.vectors = vectors
        shape = datastore.vectors.shape if rows is None else (len(rows), datastore.dim)
        if self.vectors.shape != shape or self.vectors.dtype != datastore.vectors.dtype:
            raise LayoutError(f"vectors must be {datastore.vectors.dtype} {shape} like the datastore's")
        self.index, self.quantizer = datastore.codec.empty_faiss_index(datastore.centroids, datastore.codec_params)
        self.lists = faiss.downcast_InvertedLists(self.index.invlists)  # faiss's ArrayInvertedLists
        # faiss answers passage ids: a row's, its row, unless the datastore keeps ids (`Datastore.ids`)
        ids = datastore.ids if rows is None else datastore.ids_of(rows)
        _view_lists(self.lists, self.vectors, offsets, ids)
        self.index.ntotal = shape[0]
        # How faiss spreads one call over its threads is a property of the index object, so
        # twins that share these lists carry the other settings: `search` parallelises over
        # query slices itself, but `search_preassigned` only does when told to (mode 3), and a
        # batch smaller than the thread count is better split over its lists (mode 1).
        self._twins = [self._twin(mode) for mode in (1, 3)]

    def _twin(self, parallel_mode: int) -> Any:  # a faiss IndexIVF
        twin, quantizer = self.datastore.codec.empty_faiss_index(self.datastore.centroids, self.datastore.codec_params)
        twin.replace_invlists(self.lists, False)
        twin.ntotal = self.index.ntotal
        twin.parallel_mode = parallel_mode
        twin.__dict__["_quantizer"] = quantizer  # faiss does not own it; keep it alive with the twin
        return twin

    def _for_batch(self, n: int, *, preassigned: bool) -> Any:  # a faiss IndexIVF
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

    def search(self, queries: np.ndarray, k: int, nprobe: int, *, tuned: bool = True) -> tuple[np.ndarray, np.ndarray]:
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


def _view_lists(invlists: Any, vectors: np.ndarray, offsets: np.ndarray, ids: np.ndarray | None = None) -> None:
    """Fill `invlists` with each row's id (`ids`; default: a vector's id is its row) and make
    each list's codes a view of its slice of `vectors` (faiss's `MaybeOwnedVector`, whose Python
    binding offers no constructor for a view without an owner, so its fields are set directly)."""
    code_size = invlists.code_size
    if not vectors.flags.c_contiguous:
        raise LayoutError("the lists can only view C-contiguous vectors")
    flat = vectors.reshape(-1).view(np.uint8)
    if len(flat) != int(offsets[-1]) * code_size:
        raise LayoutError(f"vectors hold {len(flat)} bytes, not {int(offsets[-1])} codes of {code_size} bytes")
    no_codes = np.zeros(1, dtype=np.uint8)
    views = faiss.MaybeOwnedVectorUInt8Vector()
    invlists.code_size = 0  # add the ids alone: faiss copies no codes
    try:
        for cluster in range(len(offsets) - 1):
            start, end = int(offsets[cluster]), int(offsets[cluster + 1])
            if end > start:
                rows = np.arange(start, end, dtype=np.int64) if ids is None else np.ascontiguousarray(ids[start:end])
                invlists.add_entries(cluster, end - start, faiss.swig_ptr(rows), faiss.swig_ptr(no_codes))
            view = faiss.MaybeOwnedVectorUInt8()
            view.is_owned = False
            view.view_data = view.c_ptr = faiss.swig_ptr(flat[start * code_size :])
            view.view_size = view.c_size = (end - start) * code_size
            views.push_back(view)
    finally:
        invlists.code_size = code_size
    invlists.codes = views


def same_results(ids: np.ndarray, scores: np.ndarray, ref_ids: np.ndarray, ref_scores: np.ndarray, tol: float = 1e-6) -> bool:
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
