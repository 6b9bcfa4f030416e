"""faiss's lists are views of the datastore's memory: the same answers as an index that copied
the codes in, with no second copy of the vectors in RAM."""

from __future__ import annotations

import faiss
import numpy as np
import pytest

from telerag.retrieval.codecs import Codec
from telerag.retrieval.errors import LayoutError
from telerag.retrieval.ivf import CPUIndex
from tests.retrieval_helpers import random_datastore, random_queries


def copied_index(ds) -> tuple[faiss.IndexIVF, faiss.Index]:
    """The plain way: faiss owns a copy of every list's codes."""
    index, quantizer = ds.codec.empty_faiss_index(ds.centroids, ds.codec_params)
    for cluster in range(ds.nlist):
        start, end = int(ds.offsets[cluster]), int(ds.offsets[cluster + 1])
        if end > start:
            ids = np.arange(start, end, dtype=np.int64)
            codes = np.ascontiguousarray(ds.vectors[start:end]).view(np.uint8)
            index.invlists.add_entries(cluster, end - start, faiss.swig_ptr(ids), faiss.swig_ptr(codes))
    index.ntotal = ds.n_vectors
    return index, quantizer


@pytest.mark.parametrize("codec", list(Codec))
def test_same_answers_as_an_index_that_copied_the_codes(tmp_path, codec):
    ds = random_datastore(tmp_path / "ds", n=3000, dim=24, nlist=20, codec=codec, empty_lists=2)
    ours = CPUIndex(ds)
    reference, _quantizer = copied_index(ds)
    queries = random_queries(16, ds.dim)
    for nprobe in (1, 5, ds.nlist):
        reference.nprobe = nprobe
        want_scores, want_ids = reference.search(queries, 10)
        scores, ids = ours.search(queries, 10, nprobe)
        np.testing.assert_array_equal(ids, want_ids)
        np.testing.assert_array_equal(scores, want_scores)


def test_the_lists_view_the_given_memory(tmp_path):
    """A write to the memory shows in faiss's answer: its lists are that memory, not a copy."""
    ds = random_datastore(tmp_path / "ds", n=1000, nlist=8)
    vectors = np.array(ds.vectors)  # writable, laid out like the datastore's
    index = CPUIndex(ds, vectors=vectors)
    q = random_queries(1, ds.dim)
    _, before = index.search(q, 1, ds.nlist)
    row = int(ds.offsets[3])
    vectors[row] = 10 * q[0]  # now by far the best match
    assert before[0, 0] != row
    assert index.search(q, 1, ds.nlist)[1][0, 0] == row


def test_refuses_memory_of_another_shape(tmp_path):
    ds = random_datastore(tmp_path / "ds", n=1000, nlist=8)
    with pytest.raises(LayoutError, match="like the datastore"):
        CPUIndex(ds, vectors=np.zeros((10, ds.dim), dtype=np.float32))
    with pytest.raises(LayoutError, match="C-contiguous"):
        CPUIndex(ds, vectors=np.asfortranarray(np.array(ds.vectors)))
