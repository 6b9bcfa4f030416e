"""Copy or scan, wait or scan: which of a search's missed clusters to copy to the device on
demand, and which resident clusters whose copies are still queued to hand to faiss instead of
waiting for them.

A cluster that was not prefetched is scanned by faiss on the CPU, which on a GPU box is often
the slower half of cooperative search (TeleRAG ch. 4 leaves it there). Copying part of the
misses while the device scans what is resident, and scanning that part on the device after it
lands, balances the halves: the CPU is given only what it can finish in the time the copy of
the rest takes. Likewise a search never waits for a queued copy longer than faiss would take to
scan that cluster beside its other lists. Rates are measured, not assumed: the copy rate of this
machine's pinned host-to-device path and faiss's scan rate in this process, each a moving average.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence

RATE_SMOOTHING = 0.2  # weight of the newest measurement in each moving average


class DemandCopyPolicy:
    """Chooses the missed clusters to copy so that copying them takes about as long as faiss
    takes over the rest (only with `copy_missed`), and the queued copies not worth waiting for.
    Until both rates have been measured it chooses nothing."""

    def __init__(self, copy_bytes_per_ms: float | None = None, *, copy_missed: bool = True, hand_late: bool = True) -> None:
        """`hand_late`: queued copies may go to faiss, which has their rows at hand (not where
        the CPU half would read them again from the same disk the copy is reading)."""
        self._lock = threading.Lock()
        self.copy_bytes_per_ms = copy_bytes_per_ms
        self.cpu_bytes_per_ms: float | None = None
        self.copy_missed = copy_missed
        self.hand_late = hand_late

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
        if not self.copy_missed or not missed or not copy_rate or not cpu_rate:
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

    def late_to_cpu(self, waiting: Sequence[tuple[int, int, int]], cpu_bytes: int) -> list[int]:
        """Which resident clusters whose copies are still queued faiss should scan instead.

        `waiting`: (cluster, bytes queued on the copy stream up to and including its copy, bytes
        faiss would read to scan it: its size once per query that probes it); `cpu_bytes`: what
        faiss reads already. The last to land go to faiss while that shortens the longer half:
        the wait for the copies kept, or faiss over its lists and those handed to it."""
        with self._lock:
            copy_rate, cpu_rate = self.copy_bytes_per_ms, self.cpu_bytes_per_ms
        if not self.hand_late or not waiting or not copy_rate or not cpu_rate:
            return []
        landing = sorted(waiting, key=lambda item: (item[1], item[0]))
        best_kept, best_ms = len(landing), max(landing[-1][1] / copy_rate, cpu_bytes / cpu_rate)
        handed = 0
        for kept in range(len(landing) - 1, -1, -1):  # keep the first `kept` to land, hand the rest over
            handed += landing[kept][2]
            wait_ms = landing[kept - 1][1] / copy_rate if kept else 0.0
            ms = max(wait_ms, (cpu_bytes + handed) / cpu_rate)
            if ms < best_ms:
                best_kept, best_ms = kept, ms
        return [cluster for cluster, _, _ in landing[best_kept:]]


def _smooth(current: float | None, nbytes: int, ms: float) -> float | None:
    if nbytes <= 0 or ms <= 0:
        return current
    rate = nbytes / ms
    return rate if current is None else (1 - RATE_SMOOTHING) * current + RATE_SMOOTHING * rate
