"""The device cluster cache: pins, budget, eviction by hotness, coalesced copies, prefetch plans."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from telerag.retrieval.cache import CacheBuffer, ClusterCache, Issued, TensorRows
from telerag.retrieval.prefetch import plan_prefetch
from tests.retrieval_helpers import DEVICES

DIM = 4
ROW_BYTES = DIM * 4


def make_cache(sizes: list[int], capacity_rows: int, device: str = "cpu") -> ClusterCache:
    offsets = np.concatenate(([0], np.cumsum(sizes))).astype(np.int64)
    host = torch.arange(int(offsets[-1]) * DIM, dtype=torch.float32).reshape(-1, DIM)
    source = TensorRows(host)
    return ClusterCache(source, offsets, CacheBuffer.for_vectors(source, capacity_rows * ROW_BYTES, torch.device(device)))


def host_of(cache: ClusterCache) -> torch.Tensor:
    assert isinstance(cache.source, TensorRows)
    return cache.source.host


def rows_of(cache: ClusterCache, lease, cluster: int) -> torch.Tensor:
    return torch.cat([cache.buffer[s.start : s.start + s.length] for s in lease.resident[cluster]]).cpu()


@pytest.mark.parametrize("device", DEVICES)
def test_copied_rows_are_the_clusters_rows(device):
    cache = make_cache([3, 5, 0, 7, 2], capacity_rows=17, device=device)
    lease = cache.acquire([4, 0, 1, 3, 2], fetch=True)
    if device == "cuda":
        torch.cuda.synchronize()
    assert set(lease.resident) == {0, 1, 3, 4}  # the empty cluster is never cached
    for cluster in lease.resident:
        start, end = int(cache.offsets[cluster]), int(cache.offsets[cluster + 1])
        torch.testing.assert_close(rows_of(cache, lease, cluster), host_of(cache)[start:end].cpu())
    lease.release()
    cache.check_invariants()


def test_adjacent_clusters_arrive_in_one_copy():
    cache = make_cache([4] * 10, capacity_rows=40)
    lease = cache.acquire([2, 3, 4, 5, 8], fetch=True)
    assert lease.clusters_copied == 5
    assert lease.copies == 2  # clusters 2-5 are one slice of host memory, 8 is another
    assert lease.bytes_copied == 5 * 4 * ROW_BYTES


def test_resident_clusters_are_not_copied_again():
    cache = make_cache([4] * 10, capacity_rows=40)
    cache.acquire([1, 2], fetch=True).release()
    lease = cache.acquire([1, 2, 3], fetch=True)
    assert (lease.clusters_already_resident, lease.clusters_copied) == (2, 1)
    stats = cache.stats()
    assert stats.copies == 2 and stats.bytes_copied == 3 * 4 * ROW_BYTES


def test_pinned_clusters_are_never_evicted_and_budget_holds():
    cache = make_cache([4] * 10, capacity_rows=12)
    held = cache.acquire([0, 1, 2], fetch=True)  # fills the buffer, stays pinned
    other = cache.acquire([5, 6], fetch=True)
    assert other.clusters_skipped == 2 and not other.resident
    assert set(held.resident) == {0, 1, 2}
    assert cache.stats().occupancy_bytes <= cache.stats().capacity_bytes
    other.release()
    held.release()
    again = cache.acquire([5, 6], fetch=True)
    assert set(again.resident) == {5, 6}
    assert cache.stats().evictions == 2
    cache.check_invariants()


def test_eviction_keeps_hot_clusters():
    cache = make_cache([4] * 10, capacity_rows=12)
    for _ in range(5):
        cache.acquire([0], fetch=True).release()  # cluster 0 is popular
    cache.acquire([1, 2], fetch=True).release()
    cache.acquire([3], fetch=True).release()  # must evict one of 1, 2 but not 0
    probe = cache.acquire([0, 1, 2, 3], fetch=False)
    assert 0 in probe.resident and 3 in probe.resident
    assert len(probe.resident) == 3
    probe.release()


def test_fragmented_space_still_holds_whole_clusters():
    cache = make_cache([2, 3, 2, 3, 2, 6], capacity_rows=12)
    cache.acquire([0, 1, 2, 3, 4], fetch=True).release()  # 12 rows, buffer full
    keep = cache.acquire([1, 3], fetch=False)  # pin two clusters in the middle
    lease = cache.acquire([5], fetch=True)  # 6 rows must come from 3 separate holes
    assert 5 in lease.resident and len(lease.resident[5]) >= 2
    torch.testing.assert_close(rows_of(cache, lease, 5), host_of(cache)[12:18])
    cache.check_invariants()
    keep.release()
    lease.release()


def test_a_cache_kept_full_places_clusters_whole_and_keeps_the_hot_ones():
    """Searches that each copy in tens of clusters keep the cache full. Eviction then makes room
    for a cluster in one extent where one of the coldest clusters' rows, with the free ones beside
    them, hold it: a cluster arrives in about one copy, not in pieces over the holes the coldest
    left (4.4 copies a cluster at bench retrieval's shape before), and popular clusters stay."""
    rng = np.random.default_rng(0)
    sizes = rng.integers(30, 170, 512).tolist()
    cache = make_cache(sizes, capacity_rows=sum(sizes) // 5)
    popular = [7, 100, 300]
    clusters_copied = copies = 0
    for _ in range(200):
        lease = cache.acquire(np.concatenate([popular, rng.choice(512, 48, replace=False)]), fetch=True)
        clusters_copied, copies = clusters_copied + lease.clusters_copied, copies + lease.copies
        lease.release()
        cache.check_invariants()
    assert copies < 1.3 * clusters_copied
    probe = cache.acquire(popular, fetch=False)
    assert set(probe.resident) == set(popular)
    probe.release()


def test_search_lease_counts_hits_and_misses():
    cache = make_cache([4] * 10, capacity_rows=40)
    cache.acquire([0, 1], fetch=True).release()
    lease = cache.acquire([0, 1, 2], fetch=False)
    assert set(lease.resident) == {0, 1}
    stats = cache.stats()
    assert (stats.hits, stats.misses) == (2, 1)
    lease.release()
    lease.release()  # idempotent
    assert cache.stats().pinned_clusters == 0


def test_bytes_copied_ahead_and_evicted_before_any_search_read_them_are_counted():
    """The lookahead's reads and its waste: a prefetch's copies count as ahead; those evicted
    before a search pinned them count as unread, those a search read (or copied itself) do not."""
    cache = make_cache([4] * 10, capacity_rows=16)
    cache.acquire([0, 1, 2], fetch=True, ahead=True).release()  # a prefetch
    cache.acquire([0], fetch=False).release()  # its search reads 0 only
    cache.acquire([3], fetch=True).release()  # a search's demand copy: not ahead
    stats = cache.stats()
    assert stats.bytes_copied_ahead == 3 * 4 * ROW_BYTES and stats.bytes_copied == 4 * 4 * ROW_BYTES
    cache.acquire([0, 1], fetch=True, ahead=True).release()  # resident: nothing copied, and 0 stays read
    for cluster in range(4, 10):  # each hotter than those above: every one of them evicted in turn
        for _ in range(3):
            cache.acquire([cluster], fetch=True).release()
    assert not cache.resident_mask()[:4].any()
    assert cache.stats().bytes_evicted_unread == 2 * 4 * ROW_BYTES  # 1 and 2: copied ahead, never searched
    cache.check_invariants()


class HeldRows:
    """A `RowSource` whose copies land only when the test lets each one (a slow disk, by hand)."""

    lands_in_order = False  # each when the test lets it

    def __init__(self, host: torch.Tensor) -> None:
        self.host, self.issued = host, []

    shape = property(lambda self: (int(self.host.shape[0]), int(self.host.shape[1])))
    dtype = property(lambda self: self.host.dtype)

    def buffer_rows(self, rows, device):
        return torch.empty((rows, self.host.shape[1]), dtype=self.host.dtype, device=device)

    def copy_into(self, buffer, copies, stream, *, ahead=False):
        each = []
        for start, first, rows in copies:
            gate = threading.Event()
            self.issued.append((first, gate))
            each.append(
                Gated(
                    gate,
                    lambda start=start, first=first, rows=rows: buffer[start : start + rows].copy_(
                        self.host[first : first + rows]
                    ),
                )
            )
        return Issued(Gated(None, lambda: None, each), each)


class Gated:
    def __init__(self, gate, land, parts=()):
        self.gate, self.land, self.parts, self.done = gate, land, list(parts), False

    def landed(self) -> bool:
        return all(p.landed() for p in self.parts) if self.parts else self.gate.is_set()

    def hasten(self) -> None:
        return None

    def wait(self, stream=None) -> None:
        for part in self.parts:
            part.wait()
        if self.gate is not None:
            assert self.gate.wait(5), "waited for a copy the search does not read"
            if not self.done:
                self.land()
                self.done = True

    def elapsed_ms(self):
        return 0.0 if self.landed() else None


def test_a_prefetch_issues_its_copies_in_the_order_asked_and_a_search_waits_for_its_own():
    """A slow source lands the clusters a prefetch wants most first (its plan's order, not the
    file's), and a search waits only for the copies of the clusters it reads."""
    offsets = np.arange(0, 41, 4, dtype=np.int64)  # 10 clusters of 4 rows
    host = torch.arange(40 * DIM, dtype=torch.float32).reshape(-1, DIM)
    source = HeldRows(host)
    cache = ClusterCache(source, offsets, CacheBuffer.for_vectors(source, 40 * ROW_BYTES, torch.device("cpu")))
    prefetch = cache.acquire([7, 2, 3, 0], fetch=True, ahead=True)
    assert [first // 4 for first, _ in source.issued] == [7, 2, 0], "7 first, then 2 and 3 in one copy, then 0"
    source.issued[1][1].set()  # only the copy of 2 and 3 has landed
    search = cache.acquire([3], fetch=False)
    assert [a.landed() for a in search.arrivals] == [True]
    for arrival in search.arrivals:
        arrival.wait()  # returns: it does not wait for 7 or 0
    assert torch.equal(rows_of(cache, search, 3), host[12:16])
    search.release()
    prefetch.release()


def test_rows_whose_copy_lands_out_of_order_are_given_to_another_copy_only_once_it_landed():
    """A read still in flight may land after a newer one into the same rows (reads run on several
    threads): an evicted list's rows go to the next list only once its own read landed."""
    offsets = np.arange(0, 9, 4, dtype=np.int64)  # 2 clusters of 4 rows
    host = torch.arange(8 * DIM, dtype=torch.float32).reshape(-1, DIM)
    source = HeldRows(host)
    cache = ClusterCache(source, offsets, CacheBuffer.for_vectors(source, 4 * ROW_BYTES, torch.device("cpu")))
    cache.acquire([0], fetch=True, ahead=True).release()  # read ahead, no longer wanted, its read in flight
    waiting = cache.acquire([1], fetch=True)
    assert waiting.clusters_skipped == 1 and not waiting.resident  # 0's rows are still being read into
    waiting.release()
    source.issued[0][1].set()
    landing = cache.acquire([0], fetch=False)
    landing.arrivals[0].wait()  # 0's read lands
    landing.release()
    lease = cache.acquire([1], fetch=True)  # now 0 is evicted and 1 takes its rows
    assert lease.clusters_copied == 1
    source.issued[1][1].set()
    lease.arrivals[0].wait()
    assert torch.equal(rows_of(cache, lease, 1), host[4:8])
    lease.release()
    cache.check_invariants()


def cache_on(shared: CacheBuffer, sizes: list[int], first_value: float) -> ClusterCache:
    """Another datastore's cache on `shared`: its host rows count up from `first_value`."""
    offsets = np.concatenate(([0], np.cumsum(sizes))).astype(np.int64)
    host = first_value + torch.arange(int(offsets[-1]) * DIM, dtype=torch.float32).reshape(-1, DIM)
    return ClusterCache(TensorRows(host), offsets, shared)


def test_datastores_on_one_buffer_hold_their_own_rows_and_share_eviction():
    server = make_cache([4] * 10, capacity_rows=16)
    store = cache_on(server.shared, [4] * 6, first_value=1e6)  # a vector store's lists: ids 0-5 again
    for _ in range(5):
        server.acquire([0], fetch=True).release()  # the server's list 0 is popular
    a = store.acquire([0, 1], fetch=True)  # the same list ids, another datastore: copied, not hits
    assert a.clusters_copied == 2 and a.clusters_already_resident == 0
    torch.testing.assert_close(rows_of(store, a, 1), host_of(store)[4:8])
    a.release()
    server.acquire([1], fetch=True).release()  # 16 rows: the buffer is full
    lease = store.acquire([2], fetch=True)  # evicts the coldest of either datastore, never the popular one
    assert set(lease.resident) == {2}
    lease.release()
    assert server.resident_mask()[0] and store.resident_mask()[2]
    assert server.resident_mask().sum() + store.resident_mask().sum() == 4
    assert server.stats() == store.stats() and server.stats().evictions == 1  # the buffer's numbers, one set
    server.check_invariants()


def test_a_closed_cache_leaves_the_buffer_once_its_pins_are_released():
    server = make_cache([4] * 10, capacity_rows=40)
    old = cache_on(server.shared, [4] * 5, first_value=1e6)  # a generation being replaced
    old.acquire([0, 1], fetch=True).release()
    held = old.acquire([2], fetch=True)  # a request still reads the old generation
    old.close()
    assert old.resident_mask().tolist() == [False, False, True, False, False]  # unpinned lists leave at once
    assert old.acquire([3], fetch=True).clusters_skipped == 1  # nothing more is copied for a closed datastore
    held.release()
    assert not old.resident_mask().any() and server.shared.caches == [server]
    assert server.stats().occupancy_bytes == 0
    server.check_invariants()


def test_a_buffer_refuses_rows_of_another_width():
    server = make_cache([4] * 3, capacity_rows=8)
    with pytest.raises(ValueError, match="do not fit"):
        ClusterCache(TensorRows(torch.zeros((8, DIM + 1))), np.array([0, 8]), server.shared)


def test_plan_interleaves_ranks_within_budget():
    ranked = np.array([[0, 1, 2, 3], [5, 1, 6, 7]])
    sizes = np.array([10] * 8)
    plan = plan_prefetch(ranked, sizes, budget_bytes=45)
    assert plan.clusters == [0, 5, 1, 2]  # rank 0 of each query, then rank 1 (1 once), then rank 2
    assert plan.bytes == 40
    assert plan.per_query == [frozenset({0, 1, 2}), frozenset({5, 1})]


def test_plan_reads_no_cluster_past_its_reach_whatever_the_budget():
    """A cluster is planned only where some query ranks it within the reach (ranks 0 to reach - 1)."""
    ranked = np.array([[0, 1, 2, 3], [5, 1, 6, 7]])
    sizes = np.array([10] * 8)
    assert plan_prefetch(ranked, sizes, budget_bytes=1000, reach=2).clusters == [0, 5, 1]
    assert plan_prefetch(ranked, sizes, budget_bytes=1000, reach=2.5).clusters == [0, 5, 1, 2, 6]
    assert len(plan_prefetch(ranked, sizes, budget_bytes=1000).clusters) == 7  # no reach: as far as the budget goes


def test_plan_skips_clusters_that_do_not_fit():
    plan = plan_prefetch(np.array([[0, 1, 2]]), np.array([10, 50, 10]), budget_bytes=25)
    assert plan.clusters == [0, 2] and plan.bytes == 20
    assert plan_prefetch(np.array([[0, 1]]), np.array([10, 10]), budget_bytes=0).clusters == []
