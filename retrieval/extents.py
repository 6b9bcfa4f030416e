"""Free rows of the cluster cache's buffer, as extents (start, length) kept sorted and merged.

The cache places a run of host-adjacent clusters in one extent when one fits (one copy), else
in the largest extents; rows given back merge with their free neighbours, so fragmentation
heals as clusters are evicted.
"""

from __future__ import annotations

import bisect


class FreeRows:
    """The free extents of a buffer of `capacity` rows (all free at first)."""

    def __init__(self, capacity: int) -> None:
        self._starts: list[int] = [0] if capacity else []
        self._length: dict[int, int] = {0: capacity} if capacity else {}

    @property
    def total(self) -> int:
        return sum(self._length.values())

    def extents(self) -> list[tuple[int, int]]:
        """(start, length) of each free extent, in order."""
        return [(start, self._length[start]) for start in self._starts]

    def allocate(self, rows: int) -> list[tuple[int, int]]:
        """Take `rows` free rows: the smallest single extent that fits, else the largest extents
        (the caller checks that `rows` are free)."""
        fitting = [s for s in self._starts if self._length[s] >= rows]
        if fitting:
            start = min(fitting, key=self._length.__getitem__)
            self._take(start, rows)
            return [(start, rows)]
        pieces: list[tuple[int, int]] = []
        for start in sorted(self._starts, key=self._length.__getitem__, reverse=True):
            take = min(rows, self._length[start])
            self._take(start, take)
            pieces.append((start, take))
            rows -= take
            if not rows:
                break
        return pieces

    def give_back(self, start: int, length: int) -> None:
        """Free `length` rows at `start`, merged with the free extents on either side."""
        index = bisect.bisect_left(self._starts, start)
        if index > 0:
            before = self._starts[index - 1]
            if before + self._length[before] == start:
                start, length = before, length + self._length.pop(before)
                self._starts.pop(index - 1)
                index -= 1
        if index < len(self._starts) and self._starts[index] == start + length:
            length += self._length.pop(self._starts.pop(index))
        self._starts.insert(index, start)
        self._length[start] = length

    def _take(self, start: int, rows: int) -> None:
        length = self._length.pop(start)
        index = bisect.bisect_left(self._starts, start)
        self._starts.pop(index)
        if length > rows:
            self._length[start + rows] = length - rows
            self._starts.insert(index, start + rows)
