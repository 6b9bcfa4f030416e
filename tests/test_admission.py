"""Admission with a deadline: the cost estimate, the measured service rate and each decision,
on a fake clock (nothing here times anything); then through the HTTP API: the prompt-token
cap, per-key limits and, on the tiny model, a 429 with Retry-After at once when the deadline
would be passed."""

from __future__ import annotations

import asyncio
import math
from collections import deque

import httpx
import pytest

from telerag.config.settings import Settings
from telerag.pipelines.registry import PIPELINES
from telerag.server.admission.deadline import MAX_HELD, AdmissionTicket, DeadlineAdmission
from telerag.server.admission.model import ERROR_WINDOW, EstimateError, Rates, ServiceRate
from telerag.server.admission.workload import PROFILE_MIN_SAMPLES, RequestCost
from telerag.server.app import create_app, start_serving
from telerag.server.errors import Overloaded, Refusal
from telerag.server.process.runtime import Runtime
from tests.fake_app import DATASTORE_INFO
from tests.fakes import RecordingRetriever, Reply, ScriptedEngine
from tests.scripted_pipelines import UNSURE, make, run

UNIT = RequestCost(work=100.0)


def alone(rate: float) -> ServiceRate:
    """A rate that never forgets, measured at `rate` with one request running (and, for want of
    more, taken for every number running)."""
    return ServiceRate(time_constant_s=math.inf, work={1: 100.0}, busy_s={1: 100.0 / rate})


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def admission(clock: Clock, **options) -> tuple[DeadlineAdmission, list[Refusal]]:
    """A DeadlineAdmission whose rate never forgets, whose estimates have been exact on a whole window of
    requests and that plans for the whole deadline, so that the numbers below are exact."""
    refused: list[Refusal] = []
    exact = EstimateError(ratios={level: deque([1.0] * ERROR_WINDOW) for level in range(1, 8)})
    options = {"max_concurrency": 8, "max_queue": 64, "deadline_s": 30.0, "margin": 0.0, "error": exact, **options}
    return DeadlineAdmission(
        clock=clock, on_refuse=refused.append, rate=ServiceRate(time_constant_s=math.inf), **options
    ), refused


async def measured(clock: Clock, rate: float = 10.0, **options) -> tuple[DeadlineAdmission, list[Refusal]]:
    """A DeadlineAdmission that has served one request of 100 units in 100 / rate seconds."""
    a, refused = admission(clock, **options)
    ticket = a.admit(UNIT)
    await a.start(ticket)
    clock.now += UNIT.work / rate
    a.finish(ticket, completed=True)
    assert a.rate.rates().at(1) == pytest.approx(rate)
    return a, refused


def test_service_rate_is_work_over_the_server_time_that_served_it():
    rate = ServiceRate(time_constant_s=60)
    assert not rate.rates()
    rate.served(40.0, {1: 4.0})
    assert rate.rates().at(1) == pytest.approx(10.0)
    rate.advance(300.0)  # idle: both decay alike
    assert rate.rates().at(1) == pytest.approx(10.0)
    rate.served(60.0, {1: 2.0})  # faster now: the average moves towards 30/s
    steady = rate.rates().at(1)
    assert 10.0 < steady < 30.0


def test_the_rate_is_measured_per_number_running_and_the_others_are_read_conservatively():
    """A batching engine serves more per second with more running: R(n) is kept per n. Between
    two measured n, the line between them; above the largest, no more than it; below the
    smallest m, R(m) n / m (one request alone is served at least as fast as each of m)."""
    rate = ServiceRate(time_constant_s=math.inf)
    rate.served(100.0, {2: 5.0})  # at 2 running: 20/s
    rate.served(300.0, {6: 7.5})  # at 6 running: 40/s
    rate.served(60.0, {2: 1.0, 6: 2.0})  # a request that ran at both: its work split as its time was (20 and 40 units)
    rates = rate.rates()
    assert rates.at(2) == pytest.approx(120 / 6) and rates.at(6) == pytest.approx(340 / 9.5)
    assert rates.at(4) == pytest.approx((rates.at(2) + rates.at(6)) / 2)
    assert rates.at(1) == pytest.approx(rates.at(2) / 2) and rates.at(16) == pytest.approx(rates.at(6))
    assert Rates({1: 10.0}).served({1: 2.0, 3: 1.0}) == pytest.approx(30.0)


async def test_requests_running_together_share_the_rate():
    clock = Clock()
    a, _ = admission(clock, deadline_s=None)
    tickets = [a.admit(UNIT) for _ in range(4)]
    for t in tickets:
        await a.start(t)
    clock.now += 20.0  # four at once, 100 units each in 20 s: 20 units/s in all
    for t in tickets:
        a.finish(t, completed=True)
    assert a.rate.rates().measured == pytest.approx({4: 20.0})


async def test_before_any_request_finished_one_is_admitted_at_a_time():
    clock = Clock()
    a, refused = admission(clock, max_concurrency=2)
    first = a.admit(UNIT)
    with pytest.raises(Overloaded) as info:
        a.admit(UNIT)
    assert info.value.retry_after == 1 and refused == [Refusal.CALIBRATING]
    await a.start(first)
    clock.now += 5.0
    a.finish(first, completed=True)
    assert a.admit(UNIT) and a.admit(UNIT)  # measured: 20/s


async def test_once_the_rate_is_measured_a_burst_that_fits_is_admitted_whole():
    """Right after one request measured the rate, as many as will all finish within the deadline
    are admitted at once; the next is refused."""
    clock = Clock()
    a, refused = await measured(clock, rate=10.0)  # 100 units take 10 s; nothing measured at more running
    burst = [a.admit(UNIT) for _ in range(3)]  # at 10/s in all (no gain from batching assumed): 30 s
    assert [t.estimated_s for t in burst] == pytest.approx([30.0] * 3)
    with pytest.raises(Overloaded):
        a.admit(UNIT)
    assert refused == [Refusal.DEADLINE]


async def test_a_rate_measured_at_more_running_admits_a_bigger_burst():
    clock = Clock()
    a, refused = admission(clock)
    a.rate = ServiceRate(time_constant_s=math.inf, work={1: 100.0, 8: 400.0}, busy_s={1: 10.0, 8: 10.0})  # 10/s and 40/s
    burst = [a.admit(UNIT) for _ in range(8)]  # 800 units at 40/s: 20 s
    assert burst[-1].estimated_s == pytest.approx(20.0)
    assert not refused


async def test_without_a_deadline_the_queue_bounds_what_is_admitted():
    clock = Clock()
    a, refused = admission(clock, max_concurrency=2, max_queue=1, deadline_s=None)
    for _ in range(2):
        await a.start(a.admit(UNIT))
    a.admit(UNIT)
    with pytest.raises(Overloaded) as info:
        a.admit(UNIT)
    assert info.value.retry_after == 1 and refused == [Refusal.QUEUE_FULL]  # no rate: the soonest sensible retry


async def test_a_request_that_would_finish_past_the_deadline_is_refused_with_the_time_until_it_fits():
    clock = Clock()
    a, refused = await measured(clock, rate=10.0)  # 100 units take 10 s
    tickets = [a.admit(UNIT) for _ in range(3)]  # sharing the server, all three finish in 30 s: within 30
    assert [t.estimated_s for t in tickets] == pytest.approx([30.0] * 3)
    with pytest.raises(Overloaded) as info:
        a.admit(UNIT)  # it would finish in 40 s, and so would the three
    assert refused == [Refusal.DEADLINE] and "40 s" in str(info.value)
    assert info.value.retry_after == 30  # when the three are done
    for t in tickets:
        await a.start(t)
    clock.now += 10.0  # each has had a third of the server: 33 of its 100 units, none finished, none overdue
    assert a.service_rate() == pytest.approx(10.0) and a.expected_wait_s() == pytest.approx(200 / 10)
    with pytest.raises(Overloaded) as info:
        # the four sharing: the three done in 4 * 66.7 / 10 = 26.7 s, 36.7 s after their admission; held until
        # they are done (20 s), it would take 15 s more alone
        a.admit(RequestCost(work=150.0))
    assert info.value.retry_after == 20  # when the three are done without it
    clock.now += 26.0  # none done: each has had 12 s of the server at 3 running, more than 100 units take at 10/s
    assert a.service_rate() == pytest.approx(10.0)  # only ended requests count: their work so far is unknown
    for t in tickets:
        a.finish(t, completed=True)
    assert a.rate.rates().at(3) == pytest.approx(300 / 36) and a.rate.rates().at(1) == pytest.approx(10.0)
    assert a.admit(UNIT).estimated_s == pytest.approx(10.0)  # alone, at the rate measured alone


async def test_the_rate_holds_while_requests_run_within_their_estimate():
    """The server time given to requests still running is not set against work not yet counted:
    the rate does not sag while they run, nor jump when they finish together."""
    clock = Clock()
    a, _ = await measured(clock, rate=10.0, deadline_s=None)
    tickets = [a.admit(UNIT) for _ in range(4)]
    for t in tickets:
        await a.start(t)
    for _ in range(4):
        clock.now += 10.0
        assert a.service_rate() == pytest.approx(10.0)
    for t in tickets:
        a.finish(t, completed=True)
    assert a.rate.rates().at(4) == pytest.approx(10.0)


async def test_a_completed_request_counts_the_work_it_was_served_not_its_estimate():
    """A short answer does not make the rate look faster than it is."""
    clock = Clock()
    a, _ = admission(clock, deadline_s=None)
    ticket = a.admit(RequestCost(work=110.0))
    await a.start(ticket)
    clock.now += 6.0
    a.finish(ticket, completed=True, served_work=30.0)
    assert a.rate.rates().at(1) == pytest.approx(30 / 6)
    assert a.admit(RequestCost(work=110.0)).estimated_s == pytest.approx(110 / 5)


async def test_a_request_waiting_for_a_slot_gets_no_share_until_one_frees():
    """Past `max_concurrency` running, a request waits in line: the running ones finish as if it
    were not there, and it starts when the first of them is done."""
    clock = Clock()
    a, _ = await measured(clock, rate=10.0, max_concurrency=2, deadline_s=None)
    first, second = a.admit(UNIT), a.admit(UNIT)
    for t in (first, second):
        await a.start(t)
    third = a.admit(UNIT)  # the two running share: both done in 20 s; then the third alone, 10 s more
    assert [t.estimated_s for t in (first, second, third)] == pytest.approx([20.0, 20.0, 30.0])
    clock.now += 10.0
    a.expected_wait_s()  # brings the shares up to now: the running two are half done
    a.rate = alone(10.0)  # still 10/s
    fourth = a.admit(RequestCost(work=50.0))
    # the running two are done in 10 s; the third and the fourth then share until the fourth is
    # done, 10 s later, and the third has 50 units left alone: 5 s more (both counted from admission)
    assert third.estimated_s == pytest.approx(10.0 + 25) and fourth.estimated_s == pytest.approx(20.0)
    assert first.estimated_s == pytest.approx(20.0)


async def test_each_request_reports_how_long_it_waited_for_its_slot():
    clock = Clock()
    waits: list[float] = []
    a, _ = admission(clock, max_concurrency=1, deadline_s=None, on_start=waits.append)
    first, second = a.admit(UNIT), a.admit(UNIT)
    await a.start(first)
    waiting = asyncio.create_task(a.start(second))
    await asyncio.sleep(0)
    clock.now += 7.0
    a.finish(first, completed=True)
    await waiting
    assert waits == [0.0, 7.0]


async def test_a_request_that_starts_holds_up_the_running_ones_while_its_prompt_is_prefilled():
    """The engine prefills a joining prompt between two decode steps: the running requests wait
    for it whole, however little they have left."""
    clock = Clock()
    a, _ = await measured(clock, rate=10.0, deadline_s=None)
    running = a.admit(UNIT)
    await a.start(running)
    clock.now += 9.0  # 10 units left: 1 s alone
    joining = a.admit(RequestCost(work=50.0, prefill_work=30.0))  # a 30-unit prompt: 3 s
    # then the two share: the running one's 10 units in 2 s; the joining one's last 10 alone in 1 s
    assert running.estimated_s == pytest.approx(9.0 + 3 + 2) and joining.estimated_s == pytest.approx(3 + 2 + 1.0)


async def test_a_running_request_whose_prompt_is_not_prefilled_yet_holds_up_the_others_with_it():
    """Requests admitted together (a burst) start at once, but the engine prefills every prompt
    before it decodes any: the first admitted is not expected to decode while the last's prompt
    is prefilled, so the last is not expected sooner than the first (it was, 0.7x as soon in a
    simulated burst of 16, and that error then scaled every estimate at 16 admitted)."""
    clock = Clock()
    a, _ = await measured(clock, rate=10.0, deadline_s=None)
    first = a.admit(RequestCost(work=50.0, prefill_work=30.0))
    await a.start(first)
    last = a.admit(RequestCost(work=50.0, prefill_work=30.0))
    # both prompts first (6 s), then the two answers of 20 units side by side at 5/s each (4 s)
    assert first.estimated_s == pytest.approx(10.0) and last.estimated_s == pytest.approx(10.0)
    await a.start(last)
    clock.now += 4.5  # each has had half the server: 22.5 units, 7.5 of its prompt left
    a.admit(UNIT)  # after those (1.5 s), the two answers' 20 units beside its 100, at 10/3 per second each (6 s)
    assert first.estimated_s == pytest.approx(4.5 + 1.5 + 6) and last.estimated_s == pytest.approx(4.5 + 1.5 + 6)


async def big_one_running(clock: Clock, age: float, left: float) -> tuple[DeadlineAdmission, list[Refusal], AdmissionTicket]:
    """A DeadlineAdmission at 10/s with one request of 250 units that has run for `age` seconds and has
    `left` of them left."""
    a, refused = await measured(clock, rate=10.0)
    big = a.admit(RequestCost(work=250.0))
    assert big.estimated_s == pytest.approx(25.0)  # alone
    await a.start(big)
    clock.now += age
    a.expected_wait_s()  # brings the shares up to now
    a.rate = alone(10.0)  # still 10/s
    big.attention = {1: (250.0 - left) / 10.0}
    return a, refused, big


async def test_a_request_is_refused_if_it_would_push_an_admitted_one_past_its_deadline():
    """Admitted requests share the server: a small one admitted late delays a big one admitted
    early, though it would itself finish in time."""
    clock = Clock()
    a, refused, big = await big_one_running(clock, age=10.0, left=150.0)
    first = a.admit(RequestCost(work=50.0))  # shared: it finishes in 10 s, the big one in (50 + 150) / 10 = 20 s
    assert first.estimated_s == pytest.approx(10.0) and big.estimated_s == pytest.approx(30.0)  # at its deadline
    with pytest.raises(Overloaded) as info:
        a.admit(RequestCost(work=50.0))  # it would finish in 15 s, but the big one in 25 s: 5 s past its deadline
    assert refused == [Refusal.DEADLINE] and info.value.retry_after == 20  # when the big one is done
    assert "15 s" in str(info.value)
    assert big.estimated_s == pytest.approx(30.0) and a.n_waiting == 1  # the refused one left nothing behind


async def test_a_running_request_expected_late_holds_a_newcomer_until_it_ends_where_it_then_fits():
    """Admitting one beside it would only make it later: one that fits after it is admitted and
    waits for it to end (the server does not wait for a client's retry to fill again); one that
    does not is refused with Retry-After when it should be done."""
    clock = Clock()
    a, refused, big = await big_one_running(clock, age=20.0, left=200.0)  # 20 s more: past its deadline alone
    held = a.admit(RequestCost(work=50.0))  # after it: in 25 s
    assert refused == [] and held.held_by == (big,) and held.estimated_s == pytest.approx(25.0)
    assert big.estimated_s == pytest.approx(40.0)  # not made later
    with pytest.raises(Overloaded) as info:
        a.admit(RequestCost(work=60.0))  # it would make the held one late too, which it is not held for
    assert refused == [Refusal.DEADLINE] and info.value.retry_after == 25  # when both are done
    starting = asyncio.create_task(a.start(held))
    await asyncio.sleep(0)
    assert not starting.done() and a.n_running == 1 and a.n_waiting == 1  # a slot is free, but it is held
    clock.now += 20.0
    a.finish(big, completed=True)
    await asyncio.wait_for(starting, 1)
    assert held.running and held.held_by == ()


async def test_a_request_admitted_only_for_a_young_one_to_end_is_refused():
    """Held only after a running request that is late without it: held after one it would make
    late, it would take a place in a batch that the wait leaves smaller."""
    clock = Clock()
    a, refused, _ = await big_one_running(clock, age=2.0, left=230.0)  # 23 s more: in time, 25 s
    with pytest.raises(Overloaded):
        a.admit(RequestCost(work=60.0))  # beside it, it pushes it to 31 s; after it, it would finish in 29 s
    assert refused == [Refusal.DEADLINE]


async def test_a_request_held_for_a_late_one_may_start_as_late_as_that_ones_deadline():
    """A request expected late runs longer than the model expected already; the run stops it at
    its deadline, so one held for it is judged as starting then."""
    clock = Clock()
    a, refused = await measured(clock, rate=10.0)
    big = a.admit(RequestCost(work=200.0))
    await a.start(big)
    clock.now += 12.0  # 120 units done: 8 s to go alone, 18 s to its deadline
    for admitted in (2, 3):  # with two or three admitted, estimates have run 1.6x long: it is late
        a.error.ratios[admitted].extend([1.6] * ERROR_WINDOW)
    assert a.admit(RequestCost(work=1.0)).held_by == (big,)  # (18 + 0.1) * 1.6 = 29 s
    with pytest.raises(Overloaded):
        a.admit(RequestCost(work=30.0))  # (18 + 3) * 1.6 = 34 s; (8 + 3) * 1.6 = 18 s had it started when expected
    assert refused == [Refusal.DEADLINE]


async def test_at_most_max_held_requests_are_held_at_once():
    """Those held for the same requests start together, their prompts' prefill stalling every
    running row at once."""
    clock = Clock()
    a, refused, big = await big_one_running(clock, age=20.0, left=200.0)
    held = [a.admit(RequestCost(work=5.0)) for _ in range(MAX_HELD)]
    assert all(t.held_by == (big,) for t in held)
    with pytest.raises(Overloaded):
        a.admit(RequestCost(work=5.0))
    assert refused == [Refusal.DEADLINE]


async def test_a_request_held_and_cancelled_leaves_nothing_behind():
    clock = Clock()
    a, _, big = await big_one_running(clock, age=20.0, left=200.0)
    held = a.admit(RequestCost(work=50.0))
    assert held.held_by == (big,)
    starting = asyncio.create_task(a.start(held))
    await asyncio.sleep(0)
    starting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await starting
    assert held.finished and a.n_waiting == 0 and a.n_running == 1


def test_the_estimate_error_is_a_high_quantile_of_took_over_estimated_at_each_load():
    error = EstimateError(window=20, quantile=0.9, min_samples=5, load_samples=5)
    for _ in range(4):
        error.observe(10.0, 30.0)
    assert error.factor(1) == 1.0  # too few to say
    error.observe(10.0, 30.0)
    assert error.factor(1) == pytest.approx(3.0)
    for took in range(1, 21):  # the window now holds ratios 0.1 .. 2.0; the 90th percentile is 1.8
        error.observe(10.0, float(took))
    assert len(error.ratios[1]) == 20 and error.factor(1) == pytest.approx(1.8)
    for _ in range(20):
        error.observe(10.0, 7.0)  # finished sooner than estimated: estimates are scaled down, to the slowest
    assert error.factor(1) == pytest.approx(0.7)
    for _ in range(20):
        error.observe(10.0, 1.0)
    assert error.factor(1) == pytest.approx(0.5)  # but never below half
    error.observe(0.5, 20.0)  # an estimate under a second is not compared
    assert error.factor(1) == pytest.approx(0.5)


def test_a_few_slow_requests_in_a_hundred_do_not_scale_every_estimate():
    """By default estimates are scaled by the error's 95th percentile at their load, not its
    largest: one request slowed once (a burst of prefills, a busy event loop) does not make
    admission refuse, for the next hundred, what fits; six in a hundred do."""
    error = EstimateError()
    for _ in range(95):
        error.observe(10.0, 10.0)
    for _ in range(5):
        error.observe(10.0, 13.0)
    assert error.factor(1) == pytest.approx(1.0)
    error.observe(10.0, 13.0)  # the window keeps 100: 94 on time, 6 at 1.3x
    assert error.factor(1) == pytest.approx(1.3)


def test_a_load_not_measured_enough_takes_every_loads_worst_and_one_never_seen_more():
    """An estimate made with 8 admitted is scaled by the error measured with 8 admitted, once
    there are enough; before, by the largest of every load's, at least 1; and with more admitted
    than any load measured, by half as much again."""
    error = EstimateError(window=20, quantile=1.0, min_samples=3, load_samples=5)
    for _ in range(5):
        error.observe(10.0, 6.0, in_flight=1)  # alone: pessimistic
        error.observe(10.0, 9.0, in_flight=8)  # with 8 admitted: pessimistic too
    assert error.factor(1) == pytest.approx(0.6) and error.factor(8) == pytest.approx(0.9)
    assert error.factor(4) == 1.0  # 4 admitted: not measured, and no load's worst is over 1
    assert error.factor(9) == pytest.approx(1.5)  # 9: more than any measured
    error.observe(10.0, 14.0, in_flight=2)
    assert error.factor(4) == pytest.approx(1.4) and error.factor(1) == pytest.approx(0.6)


async def test_requests_that_finished_later_than_estimated_make_admission_more_careful():
    clock = Clock()
    a, refused = await measured(clock, rate=6.25, max_concurrency=1, error=EstimateError(load_samples=10))  # 100 units: 16 s
    for _ in range(10):  # each estimated at 16 s (alone), each takes 24 s: 1.5 times as long
        ticket = a.admit(UNIT)
        await a.start(ticket)
        assert ticket.estimated_s == pytest.approx(16.0)
        clock.now += 24.0
        a.finish(ticket, completed=True)
        a.rate = alone(6.25)  # only the error changes
    assert a.error.factor(1) == pytest.approx(1.5) and a.error.factor(2) == pytest.approx(2.25)  # never seen: 1.5x more
    assert a.admit(UNIT)  # 16 s estimated, 24 s scaled: within 30
    assert a.expected_wait_s() == pytest.approx(24.0)
    with pytest.raises(Overloaded) as info:
        a.admit(UNIT)  # after the first, in its one slot: 32 s estimated, 72 s scaled (2 admitted)
    assert refused == [Refusal.DEADLINE] and info.value.retry_after == 42  # it would fit 42 s later


async def test_an_estimate_too_short_to_threaten_the_deadline_is_not_compared():
    """A request estimated at a third of the deadline that took its whole length says little
    about one estimated near the deadline: estimates under `ERROR_COMPARED_SHARE` of the planned
    deadline leave the error as it was."""
    clock = Clock()
    a, _ = await measured(clock, rate=10.0, error=EstimateError())
    for took in (30.0, 16.5):  # estimated at 10 s (not compared), then at 15 s (compared)
        ticket = a.admit(UNIT if took == 30.0 else RequestCost(work=150.0))
        await a.start(ticket)
        clock.now += took
        a.finish(ticket, completed=True)
        a.rate = alone(10.0)
    assert {n: list(r) for n, r in a.error.ratios.items()} == {1: [pytest.approx(1.1)]}


async def test_the_error_scales_the_whole_estimate_as_it_was_measured():
    """The error is measured as time from admission to finish over the estimate of it, so it
    scales that whole time, not only what is left of it: a request 12 s in with 8 s to go, at
    1.6x, is expected at 32 s, past a 30 s deadline, so a newcomer waits for it to end (at 12 + 1.6
    * 8 = 24.8 s it would run beside it)."""
    clock = Clock()
    a, refused = await measured(clock, rate=10.0)
    big = a.admit(RequestCost(work=200.0))
    await a.start(big)
    clock.now += 12.0  # 120 units done: 8 s to go alone
    a.error.ratios[2].extend([1.6] * ERROR_WINDOW)  # with two admitted, estimates have run 1.6x long
    assert a.error.factor(2) == pytest.approx(1.6)
    assert a.admit(RequestCost(work=1.0)).held_by == (big,) and refused == []


async def test_admission_plans_to_finish_within_the_deadline_less_its_margin():
    clock = Clock()
    a, refused = await measured(clock, rate=10.0, margin=0.1)  # plans for 27 of the 30 s
    a.admit(UNIT)
    with pytest.raises(Overloaded):
        a.admit(RequestCost(work=180.0))  # shared: 20 + 8 = 28 s
    assert refused == [Refusal.DEADLINE]
    assert a.admit(RequestCost(work=170.0)).estimated_s == pytest.approx(27.0)


async def test_a_bigger_request_is_refused_where_a_smaller_one_is_admitted():
    clock = Clock()
    a, refused = await measured(clock, rate=10.0)
    a.admit(RequestCost(work=200.0))  # 20 s of work ahead
    big = RequestCost(work=200.0)  # 40 s in all
    with pytest.raises(Overloaded):
        a.admit(big)
    assert a.admit(UNIT)  # 30 s in all
    assert refused == [Refusal.DEADLINE]


async def test_no_deadline_admits_up_to_the_queue_and_past_it_retry_after_is_when_a_slot_frees():
    clock = Clock()
    a, refused = await measured(clock, rate=10.0, max_concurrency=1, max_queue=1, deadline_s=None)
    running = a.admit(UNIT)
    await a.start(running)
    a.admit(UNIT)  # waits
    clock.now += 3.0  # the running one has 70 units to go at 10/s
    with pytest.raises(Overloaded) as info:
        a.admit(UNIT)
    assert refused == [Refusal.QUEUE_FULL] and info.value.retry_after == 7
    a.finish(running, completed=True)
    assert a.admit(UNIT)  # a place in the queue is free again


async def test_one_api_key_cannot_take_every_slot():
    clock = Clock()
    a, refused = await measured(clock, rate=10.0, max_in_flight_per_key=2, deadline_s=None)
    first = a.admit(UNIT, "key-0")
    await a.start(first)
    a.admit(UNIT, "key-0")
    with pytest.raises(Overloaded) as info:
        a.admit(UNIT, "key-0")
    assert refused == [Refusal.KEY_LIMIT] and info.value.retry_after == 20  # when its first request finishes: the two share
    assert a.admit(UNIT, "key-1") and a.admit(UNIT)  # another key, and the open API, are not held back
    a.finish(first, completed=True)
    assert a.admit(UNIT, "key-0")


async def test_the_service_a_cancelled_request_took_is_lost():
    clock = Clock()
    a, _ = await measured(clock, rate=10.0)
    ticket = a.admit(UNIT)
    await a.start(ticket)
    clock.now += 2.0
    a.finish(ticket, completed=False)
    assert a.rate.rates().at(1) == pytest.approx(100 / 12)  # two busy seconds with no work done
    a.finish(ticket, completed=False)  # finishing twice is harmless
    assert a.n_running == 0 and a.n_waiting == 0
    await asyncio.wait_for(a.drain(), 1)


async def test_a_request_cancelled_while_waiting_for_a_slot_leaves_nothing_behind():
    clock = Clock()
    a, _ = await measured(clock, rate=10.0, max_concurrency=1)
    running = a.admit(UNIT)
    await a.start(running)
    waiter = asyncio.create_task(a.start(a.admit(UNIT)))
    await asyncio.sleep(0)
    assert a.n_waiting == 1
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert a.n_waiting == 0 and a.n_running == 1


@pytest.mark.parametrize(
    ("name", "script"),
    [
        ("naive", {}),
        ("hyde", {}),
        ("subquestion", {}),
        ("iter_retgen", {}),
        ("iterative", {"judge": "no"}),
        ("self_rag", {"critique": "no"}),
        ("flare", {"flare_logprobs": [(UNSURE,) * 4] * 8}),
    ],
)
async def test_each_pipeline_declares_the_most_llm_calls_it_makes(name, script):
    pipeline, _, _, log = make(name, **script)  # scripted to take its longest path
    await run(pipeline)
    assert sum(kind == "llm_start" for kind, _ in log) == PIPELINES[name].llm_calls


# -- through the HTTP API -------------------------------------------------------------------------


def app_client(engine, **sections) -> tuple[httpx.AsyncClient, object]:
    settings = Settings(**sections)
    runtime = Runtime(settings=settings, engine=engine, retriever=RecordingRetriever(), datastore_info=DATASTORE_INFO)
    app = create_app(settings)
    start_serving(app, runtime)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test", timeout=60), app


def refusals(metrics: str, reason: str) -> float:
    line = next(
        line for line in metrics.splitlines() if line.startswith(f'telerag_admission_refusals_total{{reason="{reason}"}}')
    )
    return float(line.split()[-1])


async def test_a_client_asking_one_question_after_another_is_never_refused():
    """An answer leaves only once its request has left admission, so a client with a limit of one
    request in flight can send the next as soon as it has the last."""
    engine = ScriptedEngine(lambda prompt: Reply("fine"))
    client, app = app_client(engine, scheduler={"max_in_flight_per_key": 1}, server={"api_key": "k"})
    admission = app.state.service.admission
    async with client:
        for _ in range(20):
            answer = await client.post("/v1/rag/query", json={"query": "q?"}, headers={"Authorization": "Bearer k"})
            assert answer.status_code == 200
            assert admission.n_running + admission.n_waiting == 0


async def test_over_the_prompt_token_cap_is_422_naming_the_field():
    engine = ScriptedEngine(lambda prompt: Reply("fine"))  # a token is a word
    client, _ = app_client(engine, limits={"max_prompt_tokens": 1000})  # passages of 100 words: 150 tokens
    async with client:
        ok = await client.post("/v1/rag/query", json={"query": "short question", "top_k": 6})  # 2 + 900
        too_many = await client.post("/v1/rag/query", json={"query": "short question", "top_k": 7})  # 2 + 1050
        long_query = await client.post("/v1/rag/query", json={"query": "w " * 1001, "top_k": 1})
        chat = await client.post(
            "/v1/chat/completions", json={"model": "naive", "messages": [{"role": "user", "content": "w " * 999}]}
        )
        metrics = (await client.get("/metrics")).text
    assert ok.status_code == 200
    assert too_many.status_code == 422 and too_many.json()["error"]["field"] == "top_k"
    assert "1000" in too_many.json()["error"]["message"]
    assert long_query.status_code == 422 and long_query.json()["error"]["field"] == "query"
    assert chat.status_code == 422 and chat.json()["error"]["field"] == "messages"
    assert refusals(metrics, "prompt_tokens") == 3


async def test_per_key_limit_with_several_api_keys_and_the_single_key_still_works():
    engine = ScriptedEngine(lambda prompt: Reply("slow answer"), delay=0.3)
    client, _ = app_client(
        engine,
        server={"api_key": "solo", "api_keys": ["alpha", "beta"]},
        scheduler={"max_in_flight_per_key": 1, "admission_deadline_s": None},
    )
    body = {"query": "q?"}
    async with client:
        first = asyncio.create_task(client.post("/v1/rag/query", json=body, headers={"Authorization": "Bearer alpha"}))
        await asyncio.sleep(0.1)
        second = await client.post("/v1/rag/query", json=body, headers={"Authorization": "Bearer alpha"})
        other = await client.post("/v1/rag/query", json=body, headers={"Authorization": "Bearer beta"})
        solo = await client.post("/v1/rag/query", json=body, headers={"Authorization": "Bearer solo"})
        wrong = await client.post("/v1/rag/query", json=body, headers={"Authorization": "Bearer gamma"})
        assert (await first).status_code == 200
        metrics = (await client.get("/metrics")).text
    assert second.status_code == 429 and int(second.headers["retry-after"]) >= 1
    assert "API key" in second.json()["error"]["message"]
    assert other.status_code == 200 and solo.status_code == 200 and wrong.status_code == 401
    assert refusals(metrics, "key_limit") == 1


@pytest.mark.slow  # about 18 s on two busy cores: the tiny model generates slowly there
async def test_on_the_tiny_model_a_request_past_the_deadline_gets_429_at_once_and_one_that_never_fits_is_cut():
    """Through the whole app: with estimates among two admitted known to run 100x long, a second
    request is refused at once (429, `Retry-After`) while the first runs; and once the deadline
    is too short for a request even alone, an idle server admits it and cuts its answer at the
    deadline, whether its token limit is its own or the server's, on every route (no schema can
    say how many tokens a deadline holds, so a limit is never refused for it)."""
    from tests.tiny_models import tiny_engine

    engine = tiny_engine()
    client, app = app_client(engine)
    admission = app.state.service.admission
    long = {"query": "Tell me everything about the Nile", "max_tokens": 200}
    try:
        async with client:
            for _ in range(PROFILE_MIN_SAMPLES):  # they measure the rate and naive's answers
                warm = await client.post("/v1/rag/query", json={"query": "warm up", "max_tokens": 4})
                assert warm.status_code == 200
            admission.error.ratios[1] = deque([1.0] * 8)  # alone, estimates hold
            admission.error.ratios[2] = deque([100.0] * 8)  # two admitted: they run 100x long
            running = asyncio.create_task(client.post("/v1/rag/query", json=long))
            while admission.n_running == 0:
                await asyncio.sleep(0.01)
            refused = await client.post("/v1/rag/query", json=long)
            assert not running.done(), refused.json()  # answered while the admitted request still runs
            assert (await running).status_code == 200
            admission.deadline_s = 0.001
            never = await client.post("/v1/rag/query", json=long)  # idle: admitted, and cut
            unset = await client.post("/v1/rag/query", json={"query": long["query"]})  # no limit of its own: the same
            question = [{"role": "user", "content": long["query"]}]
            unset_chat = await client.post("/v1/chat/completions", json={"model": "naive", "messages": question})
            chat = await client.post(
                "/v1/chat/completions", json={"model": "naive", "messages": question, "max_completion_tokens": 200}
            )
            response = await client.post(
                "/v1/responses", json={"model": "naive", "input": long["query"], "max_output_tokens": 200}
            )
            metrics = (await client.get("/metrics")).text
    finally:
        await engine.close()
    assert refused.status_code == 429
    assert refused.json()["error"]["type"] == "deadline" and "deadline" in refused.json()["error"]["message"]
    retry_after = int(refused.headers["retry-after"])
    assert retry_after >= 1 and retry_after == math.ceil(float(retry_after))
    assert never.status_code == 200 and never.json()["finish_reason"] == "deadline", never.text
    assert unset.status_code == 200 and unset.json()["finish_reason"] == "deadline", unset.text
    for answered in (unset_chat, chat):  # OpenAI's finish reasons have no deadline: the limit's
        assert answered.status_code == 200 and answered.json()["choices"][0]["finish_reason"] == "length", answered.text
    assert response.status_code == 200 and response.json()["status"] == "incomplete", response.text
    assert response.json()["incomplete_details"] == {"reason": "max_output_tokens"}
    assert refusals(metrics, "deadline") == 1


async def test_the_warm_up_measures_the_rate_and_every_pipeline_so_that_none_is_costed_by_the_prior():
    """After the warm-up no pipeline is on the prior's guess (for a multi-call pipeline several
    times its work: under load it never fitted beside the others, so it was refused and never
    measured), and the rate is known alone and up to the burst."""
    engine = ScriptedEngine(lambda prompt: Reply("a short answer."))
    client, app = app_client(engine)
    service = app.state.service
    async with client:
        unmeasured = {name: service.workload.estimate(name, p.llm_calls, 400, 64) for name, p in service.pipelines.items()}
        await service.warm_up()
        measured = {name: service.workload.estimate(name, p.llm_calls, 400, 64) for name, p in service.pipelines.items()}
    assert set(measured) == set(PIPELINES)
    for name, cost in measured.items():
        assert cost != unmeasured[name] and cost.work < unmeasured[name].work, name  # its own measure, not the guess
    assert not measured["naive"].tentative  # the burst measured naive enough; the others once each
    assert all(measured[name].tentative for name in PIPELINES if name != "naive")
    assert set(service.admission.rate.rates().measured) >= {1, 8}
    assert service.admission.n_running + service.admission.n_waiting == 0


async def test_a_request_is_judged_at_its_own_costs_quantile_and_the_others_at_their_share():
    """Among n, a cost's spread counts spread/sqrt(n) towards the finishes of all (n lengths vary
    sqrt(n) times as much as one, not n times), but a request waits on its own length whole."""
    clock = Clock()
    a, _ = await measured(clock, rate=10.0)
    await a.start(a.admit(RequestCost(work=100.0)))
    with pytest.raises(Overloaded):  # its share, 185 units, done at 28.5 s; its own quantile, 220, at 32 s
        a.admit(RequestCost(work=100.0, spread=120.0))
    assert a.admit(RequestCost(work=100.0, spread=100.0)).estimated_s == pytest.approx(27.07, abs=0.01)  # own: 30 s


async def test_a_cost_that_was_short_is_its_pipelines_error_and_a_slow_server_the_models():
    """A request that took 4x its estimate because it had 4x the work (a pipeline's first
    requests are costed from one) says nothing of the rates or the sharing, and counted, one such
    request would scale every estimate of every pipeline: its time is compared with its estimate
    made again with the work it had, its own and that of those that ran beside it. One that took
    4x with the work it was costed is the model's error, and counts."""
    clock = Clock()
    a, _ = await measured(clock, rate=10.0)

    async def run(*costs: tuple[RequestCost, float], seconds: float) -> None:
        """`costs` (each with the work it was served) admitted at once; all done after `seconds`."""
        tickets = [(a.admit(cost), served) for cost, served in costs]
        for ticket, _ in tickets:
            await a.start(ticket)
        clock.now += seconds
        for ticket, served in tickets:
            a.finish(ticket, completed=True, served_work=served)

    await run((RequestCost(work=200.0, tentative=True), 800.0), seconds=80.0)  # 4x the work, 4x the time
    assert a.error.ratios[1][-1] == pytest.approx(1.0)
    await run((RequestCost(work=100.0), 300.0), (RequestCost(work=100.0), 300.0), seconds=60.0)  # both 3x: 3x as long
    assert list(a.error.ratios[2])[-2:] == pytest.approx([1.0, 1.0])
    await run((RequestCost(work=200.0), 200.0), seconds=80.0)  # the work it was costed, 4x the time
    assert a.error.ratios[1][-1] == pytest.approx(4.0)


async def test_streamed_requests_are_admitted_and_measured_like_the_others():
    engine = ScriptedEngine(lambda prompt: Reply("a streamed answer"))
    client, app = app_client(engine)
    admission = app.state.service.admission
    async with client:
        async with client.stream("POST", "/v1/rag/query", json={"query": "q?", "stream": True}) as response:
            assert response.status_code == 200
            raw = "".join([chunk async for chunk in response.aiter_text()])
        assert "event: result" in raw
        assert admission.n_running == admission.n_waiting == 0 and admission.rate.rates()
        async with client.stream(
            "POST",
            "/v1/chat/completions",
            json={"model": "naive", "stream": True, "messages": [{"role": "user", "content": "q?"}]},
        ) as response:
            assert "[DONE]" in "".join([chunk async for chunk in response.aiter_text()])
    assert admission.n_running == admission.n_waiting == 0


async def test_a_request_expected_past_the_deadline_even_alone_is_admitted_on_an_idle_server_only():
    """Its token limit, its own or the server's, is longer than the server decodes within the
    deadline: an idle server admits it (its answer is cut at the deadline), a busy one refuses it
    with a 429 to retry, never a 422 (no schema can say how many tokens a deadline holds)."""
    clock = Clock()
    a, refused = await measured(clock, rate=10.0)  # 30 s deadline, no margin
    long = a.admit(RequestCost(work=310.0))  # 31 s alone
    assert refused == [] and a.n_running + a.n_waiting == 1
    with pytest.raises(Overloaded):
        a.admit(RequestCost(work=310.0))  # the load decides: retry later
    a.finish(long, completed=False)
    assert refused == [Refusal.DEADLINE]


async def test_the_priors_guess_never_refuses_a_request_that_would_run_alone():
    """A pipeline not measured yet is costed by the prior (`RequestCost.tentative`): alone on
    the server it is admitted however long the guess, or it would never be measured."""
    clock = Clock()
    a, refused = await measured(clock, rate=10.0)
    guess = a.admit(RequestCost(work=500.0, tentative=True))  # 50 s by the guess
    assert guess.estimated_s == pytest.approx(50.0) and refused == []
    with pytest.raises(Overloaded):
        a.admit(RequestCost(work=10.0))  # but nothing joins it that would make it later still
    assert refused == [Refusal.DEADLINE]
