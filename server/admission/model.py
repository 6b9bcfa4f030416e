"""What admission measures: the server's service rate at each number of requests running, and the
error of the finishes it estimated from it (see `server/admission/deadline.py` for how both are used).

A batching engine serves more per second the more requests it runs at once (one decode step
serves every row), so the rate is measured per number running, R(n), in work units per second of
the whole server (`workload`). Each running request accrues its share of the server's time at
each n (dt / n while n run); when it ends, the work it was served is split over the n it ran at
in proportion to those shares, and R(n) is the work so counted at n over the shares at n, both
summed with weights that decay with time. A request's work counts with the server time that
served it, not with all the time the server was busy, so the rate does not jump when several
finish together. Only ended requests count: a running one that has had more time than its
expected work is not counted as it stands (its work so far is unknown, and counting only its
expected work dragged a rate measured on few requests to a fraction of itself, so that with one
request running the next was refused in a real soak); what runs over shows in the error of its
estimate when it ends (`EstimateError`).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

RATE_TIME_CONSTANT_S = 120.0  # how long the measured rates remember
ERROR_WINDOW = 100  # completed requests whose estimate error is remembered, at each load
ERROR_QUANTILE = 0.95  # of that error, what scales an estimate. Each request is already judged with its own work at
# its cost's quantile (`workload.COST_QUANTILE`, 0.9), and is late only when that work and the model's error together
# run past the plan: for two independent log-normal errors of like spread, 2 in 100 of those planned right at the
# deadline, fewer of the rest (the margin). The largest of the window (1.0, before) stacked a second worst case on the
# cost's: in the mix at 64 users one slow request of 100 scaled 61 of 75 admissions by 1.30, and the refusals kept
# admitted requests in time that finished by a p99 of 25.1 s of 30. On the simulated mix (16 seeds, 16 and 64 clients,
# tests/test_admission_load.py): goodput 1.01-1.04x the best fixed N at 1.0, 1.01-1.07x at 0.95, 1.04-1.05x at 0.9;
# late 15 of 3,043, 24 of 3,117 (0.8%), 40 of 3,134 (2.2% in one set of 8 seeds)
ERROR_MIN_SAMPLES = 3  # below this many in all, estimates are not scaled (from 3 on, the largest of few is near their worst)
ERROR_LOAD_SAMPLES = 8  # a load's own error scales its estimates from this many on (the warm-up's burst measures as
# many at 8 admitted); before, every load's pooled, at least 1. On the simulated load (tests/test_admission_load.py, 12
# runs, with the 20% margin of then) no accepted request finished past the deadline with 8, 12 or 20 (p99 at most
# 26.5, 25.4, 25.4 s of 30)
UNSEEN_LOAD_FACTOR = 1.5  # more requests admitted than at any load with ERROR_MIN_SAMPLES measured: estimates x 1.5
# (on the simulated load, estimates at 15 admitted ran 1.3-1.5x long where the warm-up had measured 8 at 0.4-0.6x)
ERROR_FLOOR = 0.5  # estimates that proved pessimistic are scaled down, but never below half
ERROR_MIN_ESTIMATE_S = 1.0  # a shorter estimate is not compared (a 0.1 s estimate that took 0.5 s says little about 30 s)

Attention = Mapping[int, float]  # seconds of the whole server a request has had, by the number running then


@dataclass(frozen=True)
class Rates:
    """R(n) for every n, from the measured ones: a measured n's own; between two measured ones,
    the line between them; above the largest measured, its rate (no more gain from batching is
    assumed than was seen); below the smallest measured m, R(m) n / m (a request alone is served
    at least as fast as one of m). Empty (no n measured): nothing is known."""

    measured: Mapping[int, float]

    def __bool__(self) -> bool:
        return bool(self.measured)

    def at(self, n: int) -> float:
        known = sorted(self.measured)
        if n in self.measured:
            return self.measured[n]
        if n < known[0]:
            return self.measured[known[0]] * n / known[0]
        if n > known[-1]:
            return self.measured[known[-1]]
        below = max(k for k in known if k < n)
        above = min(k for k in known if k > n)
        low, high = self.measured[below], self.measured[above]
        return low + (high - low) * (n - below) / (above - below)

    def served(self, attention: Attention) -> float:
        """The work a request with this `attention` has been served at these rates."""
        return sum(self.at(n) * seconds for n, seconds in attention.items())


@dataclass
class ServiceRate:
    """R(n), the work units per second of the whole server with n requests running, as measured
    on the requests that ended (see the module's docstring)."""

    time_constant_s: float = RATE_TIME_CONSTANT_S
    work: dict[int, float] = field(default_factory=dict)  # by n running
    busy_s: dict[int, float] = field(default_factory=dict)

    def advance(self, dt: float) -> None:
        decay = math.exp(-dt / self.time_constant_s)
        for n in self.work:
            self.work[n] *= decay
            self.busy_s[n] *= decay

    def served(self, work: float, attention: Attention) -> None:
        """A request ended having been served `work` units over `attention`."""
        _count(self.work, self.busy_s, work, attention)

    def rates(self) -> Rates:
        return Rates({n: self.work[n] / s for n, s in self.busy_s.items() if s > 0 and self.work[n] > 0})


def _count(work: dict[int, float], busy_s: dict[int, float], served: float, attention: Attention) -> None:
    """Add a request's `served` work, split over the n of its `attention` in proportion to the
    time at each, and that time."""
    total = sum(attention.values())
    for n, seconds in attention.items():
        if seconds > 0:
            work[n] = work.get(n, 0.0) + served * seconds / total
            busy_s[n] = busy_s.get(n, 0.0) + seconds


@dataclass
class EstimateError:
    """How much later than estimated the recent requests finished: the ratio of each completed
    request's time from admission to finish over its unscaled estimate, the last `window` at each
    load (the requests admitted, itself included, when it was last estimated).

    The model errs differently at different loads (it reads unmeasured rates conservatively; the
    more requests join, the more their prefills hold up the running ones), so an estimate is
    scaled by the error at its own load once `load_samples` are measured there: their `quantile`,
    at least `floor` (below 1 where even the slowest finished sooner than estimated: refusing on a
    pessimistic model costs answers for nothing). Before, by the quantile of every load's, at least
    1 (1 until `min_samples` are in); and a load above every one with `min_samples` measured, one
    the window has never seen, by `UNSEEN_LOAD_FACTOR` more."""

    window: int = ERROR_WINDOW
    quantile: float = ERROR_QUANTILE
    min_samples: int = ERROR_MIN_SAMPLES
    load_samples: int = ERROR_LOAD_SAMPLES
    floor: float = ERROR_FLOOR
    ratios: dict[int, deque[float]] = field(default_factory=dict)  # by requests admitted

    def observe(self, estimated_s: float, took_s: float, in_flight: int = 1) -> None:
        if estimated_s < ERROR_MIN_ESTIMATE_S:
            return
        self.ratios.setdefault(in_flight, deque(maxlen=self.window)).append(took_s / estimated_s)

    def factor(self, in_flight: int = 1) -> float:
        """What an estimate made with `in_flight` requests admitted is multiplied by."""
        own = self.ratios.get(in_flight, ())
        if len(own) >= self.load_samples:
            return max(self.floor, _observed_quantile(own, self.quantile))
        pooled = [r for ratios in self.ratios.values() for r in ratios]
        if len(pooled) < self.min_samples:
            return 1.0
        factor = max(1.0, _observed_quantile(pooled, self.quantile))
        seen = max((n for n, ratios in self.ratios.items() if len(ratios) >= self.min_samples), default=0)
        return factor * UNSEEN_LOAD_FACTOR if in_flight > seen else factor


@dataclass(frozen=True)
class Measured:
    """What the deadline policy measures of the server (what `calibration` keeps across restarts)."""

    rate: ServiceRate
    error: EstimateError


def _observed_quantile(ratios: Sequence[float], q: float) -> float:
    """The least ratio at or above the `q` quantile's rank: one that was measured, never a
    value between two (numpy's inverted CDF)."""
    return float(np.quantile(ratios, q, method="inverted_cdf"))


@dataclass(frozen=True)
class Job:
    """An admitted request as the model plans it: the work it has `left`, of which `prefill` is
    what is left of its first prompt's (prefilled as it joins, or, `running` already, before the
    running ones go on); `after`: the jobs (their indices) that must have finished before it
    starts (a request admitted held, `server/admission/deadline.py`)."""

    left: float
    prefill: float
    running: bool
    after: frozenset[int] = frozenset()


def plan_finishes(rates: Rates, jobs: Sequence[Job], max_concurrency: int) -> list[float]:
    """Seconds from now until each of `jobs` (in admission order) finishes: the n running share
    R(n) equally, and the waiting ones take the slots as they free, in order; one held `after`
    others joins that order once they have all finished (a slot may stay free meanwhile). One that starts has
    its first prompt prefilled while the others wait (the engine prefills a joining prompt
    between two decode steps), then shares. Each running job finishes when the work served to
    every running one since now reaches its mark (what it had left when it joined, plus what had
    been served by then); between finishes and prefills that work grows at R(n) / n. The running
    ones' prompts not prefilled yet (a burst's, admitted together) are prefilled first, together,
    at the rate of as many: counted as prefilled once running, the last of a burst of 16 was
    expected 0.7x as soon as the others, and that error, 1.4, scaled the next burst's estimates
    (simulated)."""
    order = itertools.count()
    marks: list[tuple[float, int, int]] = []
    served = now = 0.0

    def join(i: int) -> None:
        nonlocal now
        job = jobs[i]
        now += job.prefill / rates.at(len(marks) + 1)
        heapq.heappush(marks, (served + job.left - job.prefill, next(order), i))

    started = [i for i, job in enumerate(jobs) if job.running]
    if started:
        now = sum(jobs[i].prefill for i in started) / rates.at(len(started))
    for i in started:
        heapq.heappush(marks, (jobs[i].left - jobs[i].prefill, next(order), i))
    waiting = deque(i for i, job in enumerate(jobs) if not job.running and not job.after)
    held = [i for i, job in enumerate(jobs) if not job.running and job.after]
    ended: set[int] = set()
    finishes = [0.0] * len(jobs)
    while True:
        while waiting and len(marks) < max_concurrency:
            join(waiting.popleft())
        if not marks:
            break
        running = len(marks)
        mark, _, i = heapq.heappop(marks)
        now += (mark - served) * running / rates.at(running)
        served = mark
        finishes[i] = now
        ended.add(i)
        waiting.extend(j for j in held if jobs[j].after <= ended)
        held = [j for j in held if not jobs[j].after <= ended]
    assert not held, "a job held after one that is not planned"  # `after` names earlier jobs of the same plan
    return finishes
