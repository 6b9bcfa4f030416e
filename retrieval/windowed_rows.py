"""Rows that a datastore's writer reads in order, a block at a time from first to last
(`datastore_writer.VectorRows`), while their sources lie in another order: made a window of rows
at a time, so that memory holds one window, never the whole set, and the sources are read in one
pass a window (a scaled datastore's replicas, made again: `benchmarks.scaled.ScaledRows`; a
retrain's rows, gathered from the generation before in its file's order:
`compaction.RetrainedRows`).
"""

from __future__ import annotations

import numpy as np


class WindowedRows:
    """`shape` rows of `dtype`, `window_rows` at a time: a block asked for is cut from the window
    holding it, and a block past the window's end makes the next window (`make_window`)."""

    def __init__(self, shape: tuple[int, int], dtype: np.dtype, window_rows: int) -> None:
        self.shape, self.dtype = shape, np.dtype(dtype)
        self.window_rows = max(1, window_rows)
        self._window: tuple[int, int] = (0, 0)
        self._codes = np.empty((0, shape[1]), dtype=self.dtype)
        self.windows_made = 0

    def make_window(self, first: int, end: int) -> np.ndarray:
        """Rows `first` to `end` (exclusive), as `dtype` codes."""
        raise NotImplementedError

    def __getitem__(self, rows: slice) -> np.ndarray:
        start, stop, _ = rows.indices(self.shape[0])
        parts = []
        while start < stop:
            first, end = self._window
            if not first <= start < end:
                end = min(self.shape[0], start + self.window_rows)
                self._codes = np.empty(0, dtype=self.dtype)  # the last window's memory freed before the next is made
                self._codes, self._window = self.make_window(start, end), (start, end)
                self.windows_made += 1
                first = start
            take = min(stop, end)
            if take == stop:
                parts.append(self._codes[start - first : take - first])
            else:  # a copy, and no name left on the view: this window's memory is freed before the next is made
                parts.append(self._codes[start - first : take - first].copy())
            start = take
        return np.concatenate(parts) if len(parts) != 1 else parts[0]
