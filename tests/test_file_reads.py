"""A search's reads from disk land in place (`FileRows.lay_out`, `read_laid_out`: O_DIRECT straight
into the buffer, its runs laid out to the file's alignment) into buffers used again search after
search (`BufferPool`): the rows are the file's for every row size, and a search's buffers are the
last search's."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from telerag.retrieval.buffer_pool import BufferPool
from telerag.retrieval.codecs import Codec
from telerag.retrieval.disk import KEPT_BUFFERS, DiskListSearch
from telerag.retrieval.engine import RetrievalEngine
from telerag.retrieval.file_reads import ALIGN, FileArrival, FileRows, ReadPool, _Read
from telerag.retrieval.ivf import same_results
from tests.retrieval_helpers import random_datastore, random_queries
from tests.test_disk import ds_probe

# runs (first row of the file, rows): the file's first row, runs a row apart, one row, the last rows
RUNS = [(0, 5), (6, 40), (47, 1), (300, 333), (1500, 500)]


@pytest.mark.parametrize(
    ("dim", "codec", "direct"),
    [(16, Codec.FP32, True), (384, Codec.FP32, True), (24, Codec.FP16, True), (40, Codec.SQ8, True), (385, Codec.FP32, False)],
)
def test_runs_read_in_place_are_the_files_rows(tmp_path, dim, codec, direct):
    """Every run's rows as the file holds them, read straight into an aligned buffer where the row
    size lets a run meet the file's alignment within `DIRECT_PERIOD_BYTES` (385 floats do not:
    those runs lie end to end and are copied); the slack read on either side of a run lands in
    room of its own, never on another run's rows; only the runs' bytes are counted."""
    ds = random_datastore(tmp_path / "ds", n=2000, dim=dim, nlist=8, codec=codec)
    rows = FileRows(ds)
    try:
        layout = rows.lay_out(RUNS)
        assert layout.direct == direct
        storage = BufferPool(1 << 20, 1, align=ALIGN).take(layout.nbytes).numpy()
        storage[:] = 0xAB  # whatever the last search left
        view, arrival = rows.read_laid_out(storage, layout, RUNS)
        arrival.wait()
        for at, (first, n) in zip(layout.at, RUNS, strict=True):
            np.testing.assert_array_equal(view[at : at + n], ds.vectors[first : first + n])
        assert rows.bytes_read == sum(n for _, n in RUNS) * rows.row_bytes
    finally:
        rows.close()


@pytest.mark.parametrize(("dim", "codec"), [(128, Codec.FP32), (384, Codec.FP32), (16, Codec.FP32), (384, Codec.FP16)])
def test_a_caches_reads_land_as_the_files_rows_in_place_or_through_the_scratch(tmp_path, dim, codec):
    """A cache's copies (any buffer row, any file row, one row to thousands) land as the file's
    rows, neighbours untouched: read in place where the buffer row lies at the file row's offset
    modulo the O_DIRECT alignment (always, for rows of a multiple of 512 bytes on a disk of
    512-byte blocks), else through the scratch; only the copies' bytes are counted."""
    ds = random_datastore(tmp_path / "ds", n=3000, dim=dim, nlist=8, codec=codec)
    rows = FileRows(ds)
    try:
        buffer = rows.buffer_rows(2000, torch.device("cpu"))
        copies = [(0, 0, 5), (7, 100, 1), (20, 3, 1500), (1600, 2990, 10), (1700, 1, 299), (1999, 2999, 1)]
        buffer.view(torch.uint8).fill_(0xAB)
        in_place = []
        read_in_place = rows._read_in_place
        rows._read_in_place = lambda dest, begin: (in_place.append(begin), read_in_place(dest, begin))  # type: ignore[method-assign]
        rows.copy_into(buffer, copies, None).whole.wait()
        written = np.zeros(len(buffer), dtype=bool)
        for start, first, n in copies:
            np.testing.assert_array_equal(buffer[start : start + n].numpy(), ds.vectors[first : first + n])
            written[start : start + n] = True
        assert (buffer[torch.from_numpy(~written)].view(torch.uint8) == 0xAB).all()  # nothing beyond a copy's rows
        assert rows.bytes_read == sum(n for _, _, n in copies) * rows.row_bytes
        if rows.direct and rows.direct_align == 512 and rows.row_bytes % 512 == 0:
            assert len(in_place) == len(copies)  # every copy's middle read in place
    finally:
        rows.close()


def test_a_search_reads_into_the_buffers_the_last_one_gave_back(tmp_path):
    """Searches one after another take no new buffer (memory fresh from the kernel costs more to
    touch than to read into), the pool keeps no more than a search holds at once, and the answers
    are faiss's."""
    ds = random_datastore(tmp_path / "ds", n=3000, nlist=24)
    rows = FileRows(ds)
    search = DiskListSearch(ds, rows)
    taken: list[int] = []
    take = search.buffers.take
    search.buffers.take = lambda nbytes: taken.append((buffer := take(nbytes)).data_ptr()) or buffer  # type: ignore[method-assign]
    try:
        queries = random_queries(4, ds.dim, seed=3)
        list_scores, lists = ds_probe(ds, queries, 12)
        reference = RetrievalEngine(ds)
        ref_scores, ref_ids = reference.index.search_lists(queries, 10, lists, list_scores)
        reference.close()
        for _ in range(3):
            scores, ids = search.search_lists(queries, 10, lists, list_scores)
            for i in range(len(queries)):
                assert same_results(ids[i], scores[i], ref_ids[i], ref_scores[i])
        assert len(taken) > len(set(taken))  # buffers used again
        assert len(set(taken)) <= KEPT_BUFFERS
        assert search.buffers.idle_bytes <= KEPT_BUFFERS * search.buffers.buffer_bytes
    finally:
        rows.close()


def test_a_pool_keeps_at_most_its_number_and_never_a_larger_buffer():
    pool = BufferPool(4096, 1, align=ALIGN)
    first, second, large = pool.take(100), pool.take(4096), pool.take(5000)
    assert all(buffer.data_ptr() % ALIGN == 0 for buffer in (first, second, large))
    for buffer in (first, second, large):
        pool.give(buffer)
    assert pool.idle_bytes == 4096
    assert pool.take(10).data_ptr() == first.data_ptr()


def test_reads_issued_together_have_landed_only_once_the_last_lands_in_any_order():
    """`FileArrival` over reads landing out of order: not landed (no elapsed time) while any is
    in flight, landed once every one is, whichever came last."""
    reads = [_Read(None) for _ in range(5)]
    arrival = FileArrival(ReadPool(0), reads)
    for index in (3, 0, 4, 1):
        reads[index].done.set_result(None)
        assert not arrival.landed() and arrival.elapsed_ms() is None
    reads[2].done.set_result(None)
    assert arrival.landed() and arrival.elapsed_ms() is not None
    assert FileArrival(ReadPool(0), []).landed()
