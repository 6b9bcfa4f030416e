"""Host buffers that a search from disk reads its parts of lists into, kept for the next part.

Memory fresh from the kernel costs far more to touch the first time than to fill again: every
page faults and is zeroed (on this project's 2-core VM about 1 ms of CPU per MB, twenty times a
refill of memory touched before), and a search from disk reads gigabytes a query into buffers of
hundreds of MB, each too large for the allocator to keep. So a search takes its buffers from a
pool and gives them back once scanned, every read into them landed; a pool keeps a bounded number,
what it holds beside the cache.
"""

from __future__ import annotations

import threading

import torch


class BufferPool:
    """Byte buffers of `buffer_bytes` each, at most `keep` of them idle at once: a buffer taken is
    an idle one where there is one, else new; one given back is kept while fewer than `keep`
    are, else freed. A request larger than `buffer_bytes` gets a buffer of its own, never kept.
    Every buffer starts at a multiple of `align` bytes (what O_DIRECT reads into)."""

    def __init__(self, buffer_bytes: int, keep: int, *, align: int = 1) -> None:
        self.buffer_bytes, self.keep, self.align = buffer_bytes, keep, align
        self._idle: list[torch.Tensor] = []
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> torch.Tensor:
        """A uint8 tensor of at least `nbytes` (its contents whatever the last user left)."""
        if nbytes > self.buffer_bytes:
            return self._new(nbytes)
        with self._lock:
            if self._idle:
                return self._idle.pop()
        return self._new(self.buffer_bytes)

    def give(self, buffer: torch.Tensor) -> None:
        """`buffer` back, no longer read or written by anyone."""
        if len(buffer) != self.buffer_bytes:
            return
        with self._lock:
            if len(self._idle) < self.keep:
                self._idle.append(buffer)

    def _new(self, nbytes: int) -> torch.Tensor:
        return aligned_bytes(nbytes, self.align)

    @property
    def idle_bytes(self) -> int:
        with self._lock:
            return len(self._idle) * self.buffer_bytes


def aligned_bytes(nbytes: int, align: int, at: int = 0) -> torch.Tensor:
    """A new uint8 tensor of `nbytes` whose first byte lies at `at` modulo `align` (what O_DIRECT reads into)."""
    raw = torch.empty(nbytes + align - 1, dtype=torch.uint8)
    skip = (at - raw.data_ptr()) % align
    return raw[skip : skip + nbytes]
