"""What the retrieval layer counts, as plain data: torch-free, so that the server can import
it (its metrics, its response models) and listen before torch is loaded."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class CacheStats:
    """The cache buffer's state and counters since it was made, over every datastore on it (all zero: no cache)."""

    capacity_bytes: int = 0
    occupancy_bytes: int = 0
    resident_clusters: int = 0
    pinned_clusters: int = 0
    hits: int = 0  # searched clusters found resident
    misses: int = 0
    evictions: int = 0
    bytes_copied: int = 0  # into the cache: by prefetches (read ahead) and on demand
    copies: int = 0
    bytes_copied_ahead: int = 0  # of `bytes_copied`, a prefetch's: copied before the search that reads them
    bytes_evicted_unread: int = 0  # copied ahead, then evicted before any search read them: the lookahead's waste
    bytes_read_for_scans: int = 0  # a datastore on disk: read by searches and scanned where read, not cached
    host_capacity_bytes: int = 0  # from disk onto a device: the host tier under the cache (`retrieval.host_tier`; 0: none)
    host_occupancy_bytes: int = 0
    host_bytes_read: int = 0  # read from disk into the host tier, on the device's copies' way
    host_hits: int = 0  # lists a search's CPU half found in the host tier: scanned there, not read


@dataclass(frozen=True)
class PrefetchStats:
    """What one prefetch planned and copied (all zero when nothing was planned)."""

    clusters_requested: int = 0  # planned for this caller's queries, resident ones included
    bytes_requested: int = 0  # of those, the bytes not resident when planned
    clusters_resident: int = 0  # already resident: pinned, not copied
    clusters_copied: int = 0
    clusters_skipped: int = 0  # planned, but they did not fit beside pinned clusters
    bytes_copied: int = 0
    copies: int = 0  # copy calls issued (adjacent clusters coalesce into one)
    bytes_queued_ahead: int = 0  # on the copy stream before this prefetch's copies
    plan_ms: float = 0.0  # ranking and planning

    @classmethod
    def combined(cls, parts: Sequence[PrefetchStats]) -> PrefetchStats:
        """One request's prefetches over several datastores (vector stores) as one: the counts
        and times added, the bytes queued ahead of the first."""
        return cls(
            clusters_requested=sum(p.clusters_requested for p in parts),
            bytes_requested=sum(p.bytes_requested for p in parts),
            clusters_resident=sum(p.clusters_resident for p in parts),
            clusters_copied=sum(p.clusters_copied for p in parts),
            clusters_skipped=sum(p.clusters_skipped for p in parts),
            bytes_copied=sum(p.bytes_copied for p in parts),
            copies=sum(p.copies for p in parts),
            bytes_queued_ahead=parts[0].bytes_queued_ahead if parts else 0,
            plan_ms=sum(p.plan_ms for p in parts),
        )
