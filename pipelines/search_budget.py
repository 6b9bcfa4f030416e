"""nprobe "auto" (PipeRAG's performance model): the largest nprobe whose predicted search time
fits inside the generation the search overlaps, never below a floor.

A search's time, as the pipeline waits for it (queueing behind other searches, the embedding,
the probe and the scan), is modelled as linear in nprobe and in the searches already in flight
when it starts: t = a + b·nprobe + c·depth. The coefficients are a least-squares fit, online,
over the latest searches, the older ones weighing less. Until nprobe has varied, a fit cannot
tell a fixed cost from a per-list one; a small penalty on a and c then puts the whole time into
b (time proportional to nprobe), which overestimates larger nprobes and underestimates smaller
ones: the first budgeted choices err on the short side when they go up. A search that overlaps
no generation is not budgeted: it runs at the default nprobe.
"""

from __future__ import annotations

import contextlib
import math
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

WINDOW = 128  # searches the fit remembers
FORGETTING = 0.97  # each older search weighs this much less than the next
PENALTY = 1e-3  # on a and c, relative to the searches' total weight: b takes what the data cannot tell apart


@dataclass(frozen=True)
class SearchObservation:
    nprobe: int
    depth: int  # searches in flight when it started
    ms: float


@dataclass(frozen=True)
class LinearFit:
    """t = fixed_ms + per_list_ms · nprobe + per_queued_ms · depth."""

    fixed_ms: float
    per_list_ms: float
    per_queued_ms: float

    def predict_ms(self, nprobe: int, depth: int) -> float:
        return self.fixed_ms + self.per_list_ms * nprobe + self.per_queued_ms * depth


class SearchBudget:
    """The search-time model of the pipelines built together (they share one retriever and its
    queue), and the searches they have in flight now."""

    def __init__(self, *, floor: int = 8, ceiling: Callable[[], int | None] = lambda: None) -> None:
        """`floor`: the least nprobe "auto" chooses; `ceiling()`: the most, read at each choice (the
        datastore's nlist, which a retrain changes; None: not known, so "auto" searches at the
        default nprobe)."""
        self.floor, self.ceiling = floor, ceiling
        self.in_flight = 0
        self.observations: deque[SearchObservation] = deque(maxlen=WINDOW)

    @contextlib.contextmanager
    def searching(self) -> Iterator[int]:
        """Count a search in flight while inside; gives the depth it started at."""
        depth = self.in_flight
        self.in_flight += 1
        try:
            yield depth
        finally:
            self.in_flight -= 1

    def observe(self, nprobe: int, depth: int, ms: float) -> None:
        """A search at `nprobe` (0: not known, ignored) that started `depth` deep took `ms`."""
        if nprobe > 0 and ms >= 0 and math.isfinite(ms):
            self.observations.append(SearchObservation(nprobe, depth, ms))

    def fit(self) -> LinearFit | None:
        """The weighted least-squares fit of the latest searches (None before the first)."""
        if not self.observations:
            return None
        x = np.array([(1.0, o.nprobe, o.depth) for o in self.observations])
        y = np.array([o.ms for o in self.observations])
        w = FORGETTING ** np.arange(len(y))[::-1]
        gram = (x * w[:, None]).T @ x + np.diag([1.0, 0.0, 1.0]) * PENALTY * w.sum()
        fixed, per_list, per_queued = np.linalg.solve(gram, (x * w[:, None]).T @ y)
        if per_list <= 0:  # noise or no spread in nprobe: time proportional to nprobe, as the penalty would have it
            fixed, per_list, per_queued = 0.0, float(np.average(y / x[:, 1], weights=w)), 0.0
        return LinearFit(float(fixed), float(per_list), float(max(per_queued, 0.0)))

    def choose(self, budget_ms: float) -> int | None:
        """The largest nprobe whose predicted time, at the depth in flight now, is within
        `budget_ms`, never below the floor nor above the ceiling; None (the default nprobe)
        with no ceiling or before the first search."""
        fit, ceiling = self.fit(), self.ceiling()
        if ceiling is None or fit is None:
            return None
        room = budget_ms - fit.fixed_ms - fit.per_queued_ms * self.in_flight
        largest = math.floor(room / fit.per_list_ms) if room > 0 else 0
        return max(min(self.floor, ceiling), min(largest, ceiling))
