"""Copy or scan: which of a search's missed clusters to copy to the device on demand.

A cluster that was not prefetched is scanned by faiss on the CPU, which on a GPU box is often
the slower half of cooperative search (TeleRAG ch. 4 leaves it there). Copying part of the
misses while the device scans what is resident, and scanning that part on the device after it
lands, balances the halves: the CPU is given only what it can finish in the time the copy of
the rest takes. Rates are measured, not assumed: the copy rate of this machine's pinned
host-to-device path and faiss's scan rate in this process, each a moving average.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

RATE_SMOOTHING = 0.2  # weight of the newest measurement in each moving average


class DemandCopyPolicy:
    """Chooses the missed clusters to copy so that copying them takes about as long as faiss
    takes over the rest. Until both rates have been measured it chooses nothing."""

    def __init__(self, copy_bytes_per_ms: float | None = None) -> None:
        self._lock = threading.Lock()
        self.copy_bytes_per_ms = copy_bytes_per_ms
        self.cpu_bytes_per_ms: float | None = None

    def observe_copy(self, nbytes: int, ms: float) -> None:
        with self._lock:
            self.copy_bytes_per_ms = _smooth(self.copy_bytes_per_ms, nbytes, ms)

    def observe_cpu(self, scanned_bytes: int, ms: float) -> None:
        """`scanned_bytes`: the bytes faiss read, counted once per query that read them."""
        with self._lock:
            self.cpu_bytes_per_ms = _smooth(self.cpu_bytes_per_ms, scanned_bytes, ms)

    def choose(self, missed: Mapping[int, int], cluster_bytes: Mapping[int, int]) -> list[int]:
        """`missed`: cluster -> how many queries of the batch probe it. A copied cluster saves
        faiss its bytes once per such query, so the most shared go first; clusters are added
        while that shortens the longer of the two halves (copy of the chosen, CPU over the rest)."""
        with self._lock:
            copy_rate, cpu_rate = self.copy_bytes_per_ms, self.cpu_bytes_per_ms
        if not missed or not copy_rate or not cpu_rate:
            return []
        cpu_left = sum(cluster_bytes[c] * q for c, q in missed.items()) / cpu_rate
        copy_ms = 0.0
        chosen: list[int] = []
        for cluster in sorted(missed, key=lambda c: (-missed[c], c)):
            size = cluster_bytes[cluster]
            next_copy, next_cpu = copy_ms + size / copy_rate, cpu_left - size * missed[cluster] / cpu_rate
            if max(next_copy, next_cpu) >= max(copy_ms, cpu_left):
                break
            chosen.append(cluster)
            copy_ms, cpu_left = next_copy, next_cpu
        return chosen


def _smooth(current: float | None, nbytes: int, ms: float) -> float | None:
    if nbytes <= 0 or ms <= 0:
        return current
    rate = nbytes / ms
    return rate if current is None else (1 - RATE_SMOOTHING) * current + RATE_SMOOTHING * rate
