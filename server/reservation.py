"""A pipeline's place kept until it is measured. A pipeline with fewer than a few completed
requests is costed at a wide guess (`RequestCost.provisional`), and a new request is judged at
its own tail, so under load it is refused each time it asks while the measured pipelines fill
the server, and, never admitted, it is never measured: traced on the embedded default, a mix of
seven pipelines at 16 users, FLARE was refused 18 times in 90 s and answered once, HyDE 16 times
and answered 4. So once a pipeline costed provisionally has been refused `STARVED_AFTER` times in
a row, its place is kept: until a request of it is admitted, or until the `Retry-After` it was
last given and `KEPT_GRACE_S` more have passed, a request of another pipeline is admitted only if
a request of the kept one, at the cost it was refused at, would still fit beside it, and is told
to come back when the kept one is expected. One place is kept at a time, so the server never
holds more than one request's room for a client that may not come back.

What it buys, on the simulated mix of `tests/test_admission_load.py` (seeds 0-15 at 16 and 64
clients: 32 runs): the least-answered pipeline of a run got 5.9 answers on average (none of the
32 runs had one at 2 or fewer), against 1.3-1.8 before (25 of 32 at 2 or fewer), for goodput
0.98-1.00x the best fixed number in flight's, against 1.08-1.14x by starving the costly
pipelines. Both halves are needed: `workload.FEW_SAMPLES_SPREAD` at 0.5 alone left 5 runs of 32
with a pipeline at 2 or fewer (1.05-1.07x); places kept with it at 1.0, 3 runs (0.82-0.83x). A
place kept for measured pipelines too (judged at their own spread, they are refused for their
size, not for a guess) evened them a little more (6.4-6.6) for 0.92-0.93x.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from telerag.server.workload import RequestCost

STARVED_AFTER = 3  # refusals in a row of a pipeline costed provisionally that keep its place (3-6 measured alike)
KEPT_GRACE_S = 5.0  # a place is kept this long past the Retry-After its pipeline was last given


@dataclass(frozen=True)
class Place:
    """Room kept for a request of `pipeline` costing `cost`: expected back at `expected_at`, kept
    until `until` (instants of the admission's clock)."""

    pipeline: str
    cost: RequestCost
    expected_at: float
    until: float


@dataclass
class Places:
    """Which pipeline's place is kept, from the refusals and admissions of each."""

    starved_after: int = STARVED_AFTER
    grace_s: float = KEPT_GRACE_S
    _refused: Counter[str] = field(default_factory=Counter)  # by pipeline, since its last admission
    _kept: Place | None = None

    def kept_against(self, pipeline: str | None, now: float) -> Place | None:
        """The place a request of `pipeline` must leave room for at `now`: the kept one, unless it
        is its own pipeline's (which it takes) or has expired."""
        if self._kept is not None and self._kept.until < now:
            self._kept = None
        if self._kept is None or self._kept.pipeline == pipeline:
            return None
        return self._kept

    def refused(self, pipeline: str | None, cost: RequestCost, now: float, retry_after_s: float) -> None:
        """A request of `pipeline` costing `cost` was refused because it would not finish in time,
        and told to come back in `retry_after_s`."""
        if pipeline is None or not cost.provisional:
            return
        self._refused[pipeline] += 1
        own = self._kept is not None and self._kept.pipeline == pipeline
        if own or (self.kept_against(pipeline, now) is None and self._refused[pipeline] >= self.starved_after):
            self._kept = Place(pipeline, cost, now + retry_after_s, now + retry_after_s + self.grace_s)

    def admitted(self, pipeline: str | None) -> None:
        """A request of `pipeline` was admitted: its place, if kept, is taken."""
        if pipeline is None:
            return
        self._refused.pop(pipeline, None)
        if self._kept is not None and self._kept.pipeline == pipeline:
            self._kept = None
