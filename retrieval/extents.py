"""Free rows of the cluster cache's buffer, as extents (start, length) kept sorted and merged.

The cache places a run of host-adjacent clusters in one extent when one fits (one copy), else
in the largest extents; rows given back merge with their free neighbours, so fragmentation
heals as clusters are evicted. The extents are kept in two orders, by start (to merge) and by
length (to find the smallest that fits), so that each step costs a search, not a scan: a full
cache holds hundreds of extents, and a search's demand copies place tens of clusters.
"""

from __future__ import annotations

import bisect


class FreeRows:
    """The free extents of a buffer of `capacity` rows (all free at first)."""

    def __init__(self, capacity: int) -> None:
        self._starts: list[int] = [0] if capacity else []
        self._length: dict[int, int] = {0: capacity} if capacity else {}
        self._by_length: list[tuple[int, int]] = [(capacity, 0)] if capacity else []  # (length, start), sorted
        self._total = capacity

    @property
    def total(self) -> int:
        return self._total

    def extents(self) -> list[tuple[int, int]]:
        """(start, length) of each free extent, in order."""
        return [(start, self._length[start]) for start in self._starts]

    def fits(self, rows: int) -> bool:
        """Whether one extent holds `rows` (they would arrive in one copy)."""
        return bool(self._by_length) and self._by_length[-1][0] >= rows

    def around(self, start: int, length: int) -> int:
        """The rows of the extent that giving back [start, start + length) would make: those rows
        and the free ones on either side."""
        end, merged = start + length, length
        index = bisect.bisect_left(self._starts, start)
        if index > 0 and (before := self._starts[index - 1]) + self._length[before] == start:
            merged += self._length[before]
        if index < len(self._starts) and self._starts[index] == end:
            merged += self._length[end]
        return merged

    def allocate(self, rows: int) -> list[tuple[int, int]]:
        """Take `rows` free rows: the smallest single extent that fits, else the largest extents
        (the caller checks that `rows` are free)."""
        fitting = bisect.bisect_left(self._by_length, (rows, -1))
        if fitting < len(self._by_length):
            start = self._by_length[fitting][1]
            self._take(start, rows)
            return [(start, rows)]
        pieces: list[tuple[int, int]] = []
        while rows:  # the largest, the first of equals
            length, start = self._by_length[bisect.bisect_left(self._by_length, (self._by_length[-1][0], -1))]
            take = min(rows, length)
            self._take(start, take)
            pieces.append((start, take))
            rows -= take
        return pieces

    def give_back(self, start: int, length: int) -> None:
        """Free `length` rows at `start`, merged with the free extents on either side."""
        self._total += length
        index = bisect.bisect_left(self._starts, start)
        if index > 0:
            before = self._starts[index - 1]
            if before + self._length[before] == start:
                start, length = before, length + self._remove(index - 1)
                index -= 1
        if index < len(self._starts) and self._starts[index] == start + length:
            length += self._remove(index)
        self._insert(index, start, length)

    def _take(self, start: int, rows: int) -> None:
        self._total -= rows
        index = bisect.bisect_left(self._starts, start)
        length = self._remove(index)
        if length > rows:
            self._insert(index, start + rows, length - rows)

    def _remove(self, index: int) -> int:
        """Drop the `index`th extent by start; its length."""
        start = self._starts.pop(index)
        length = self._length.pop(start)
        del self._by_length[bisect.bisect_left(self._by_length, (length, start))]
        return length

    def _insert(self, index: int, start: int, length: int) -> None:
        self._starts.insert(index, start)
        self._length[start] = length
        bisect.insort(self._by_length, (length, start))
