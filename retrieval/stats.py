"""What the retrieval layer counts, as plain data: torch-free, so that the server can import
it (its metrics, its response models) and listen before torch is loaded."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CacheStats:
    """The cache's state and counters since it was made (all zero: no cache)."""

    capacity_bytes: int = 0
    occupancy_bytes: int = 0
    resident_clusters: int = 0
    pinned_clusters: int = 0
    hits: int = 0  # searched clusters found resident
    misses: int = 0
    evictions: int = 0
    bytes_copied: int = 0
    copies: int = 0


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
