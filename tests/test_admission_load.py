"""Admission under load, on a simulated clock, against a model of the transformers engine: what
a user relies on. Under a saturating load (64 clients, each sending its next question as soon as
it has an answer, or once the `Retry-After` of a 429 has passed) the accepted requests finish
within the deadline 99 times in 100; admission's goodput (answers within the deadline per
second) is at least that of the better of the two simple policies, admitting everything (vLLM,
SGLang) and a fixed number in flight (TGI); and a burst that fits is admitted whole.

The engine is continuous batching as `pipelines/engines/transformers.py` does it: between two
decode steps the prompts that arrived are prefilled, holding up every row; then one step decodes
a token for every row, and a row leaves when its answer is done. A step takes
`STEP_S + ROW_S * rows + PREFILL_S * prompt tokens`, so a batch serves more per second than one
row alone, and a burst of arrivals stalls the rows already running. Answers stop at a random
length up to `max_tokens`. Requests are costed and measured as the service does it (`Workload`,
`ServedWork`), and the server warms up as the service does (one request alone, then a burst).
Nothing here measures time; every number is of the simulated clock.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from dataclasses import dataclass, field

import pytest

from telerag.server.admission import Admission, Ticket
from telerag.server.errors import Overloaded
from telerag.server.service import CALIBRATION_BURST
from telerag.server.workload import CallOutput, ServedWork, Workload

STEP_S, ROW_S, PREFILL_S = 0.08, 0.02, 0.002  # about the embedded Gemma on two cores
SLOTS, CLIENTS, DURATION_S, RAMP_S, DEADLINE_S, MAX_TOKENS = 16, 64, 300.0, 10.0, 30.0, 64
ANSWER_TOKENS = (5, 40)  # an answer's length, uniform (RAG answers are short; max_tokens is a bound)


@dataclass(eq=False)
class Request:
    ticket: Ticket
    client: int
    sent_at: float
    prompt_tokens: int
    tokens_left: int  # of its answer
    tokens: int = 0  # generated
    prefilled: bool = False


@dataclass
class Outcome:
    latencies: list[float] = field(default_factory=list)  # of the answered, from sending to the answer
    refusals: int = 0

    @property
    def late_share(self) -> float:
        return sum(s > DEADLINE_S for s in self.latencies) / len(self.latencies)

    @property
    def p99(self) -> float:
        ordered = sorted(self.latencies)
        return ordered[math.ceil(0.99 * len(ordered)) - 1]

    @property
    def goodput(self) -> float:
        """Answers within the deadline per second."""
        return sum(s <= DEADLINE_S for s in self.latencies) / DURATION_S


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


class Simulation:
    """One server (admission in front of the engine model) and its clients' events."""

    def __init__(self, seed: int, admission: Admission, clock: Clock) -> None:
        self.rng, self.clock, self.admission = random.Random(seed), clock, admission
        self.workload = Workload()
        self.outcome = Outcome()
        self.events: list[tuple[float, int, str, int]] = []  # (when, order, "send" | "step", client)
        self.order = itertools.count()
        self.running: list[Request] = []  # in the engine's batch
        self.stepping: list[Request] = []  # those the step in progress serves
        self.waiting: list[Request] = []  # admitted, no slot yet
        self.resend = True  # a client sends again once answered or refused
        self.end_s = math.inf

    def schedule(self, when: float, kind: str, client: int = -1) -> None:
        heapq.heappush(self.events, (when, next(self.order), kind, client))

    def step(self) -> None:
        """Start the next step with the rows running now (prefilling those that just joined)."""
        self.stepping[:] = self.running
        if self.stepping:
            prefill = sum(r.prompt_tokens for r in self.stepping if not r.prefilled)
            self.schedule(self.clock.now + STEP_S + ROW_S * len(self.stepping) + PREFILL_S * prefill, "step")

    async def take_slot(self, request: Request) -> None:
        await self.admission.start(request.ticket)  # a slot is free: returns at once
        self.running.append(request)
        if not self.stepping:
            self.step()

    async def send(self, client: int, *, calibrating: bool = False) -> None:
        prompt_tokens = self.rng.randint(430, 500)
        tokens = self.rng.randint(*ANSWER_TOKENS)
        try:
            cost = self.workload.estimate("naive", 1, prompt_tokens, MAX_TOKENS)
            ticket = self.admission.admit(cost, calibrating=calibrating)
        except Overloaded as refused:
            self.outcome.refusals += 1
            if self.resend:
                self.schedule(self.clock.now + refused.retry_after, "send", client)
            return
        request = Request(ticket, client, self.clock.now, prompt_tokens, tokens_left=tokens)
        if len(self.running) < self.admission.max_concurrency:
            await self.take_slot(request)
        else:
            self.waiting.append(request)

    async def finish(self, request: Request, record: bool) -> None:
        self.running.remove(request)
        served = ServedWork(request.prompt_tokens, (CallOutput(request.tokens, answer=True),))
        self.admission.finish(request.ticket, completed=True, served_work=served.work)
        self.workload.observe("naive", request.prompt_tokens, served)
        if record:
            self.outcome.latencies.append(self.clock.now - request.sent_at)
            if self.resend:
                self.schedule(self.clock.now, "send", request.client)
        if self.waiting:
            await self.take_slot(self.waiting.pop(0))

    async def run(self, record: bool = True) -> None:
        """Until no event is left (sends stop at `end_s`)."""
        while self.events:
            self.clock.now, _, kind, client = heapq.heappop(self.events)
            if kind == "send" and self.clock.now < self.end_s:
                await self.send(client)
            elif kind == "step":
                for request in list(self.stepping):
                    if not request.prefilled:
                        request.prefilled = True
                        continue
                    request.tokens += 1
                    request.tokens_left -= 1
                    if request.tokens_left == 0:
                        await self.finish(request, record)
                self.step()

    async def warm_up(self) -> None:
        """As the service warms up: one request alone, then a burst, both admitted whatever the
        deadline, their answers measured."""
        self.resend = False
        for size in (1, CALIBRATION_BURST):
            for _ in range(size):
                await self.send(-1, calibrating=True)
            await self.run(record=False)
        self.resend = True


def policy(kind: str, clock: Clock, n: int = SLOTS) -> Admission:
    """`deadline` (this server's), `none` (admit everything and queue) or `fixed` (at most `n`
    in flight, refuse the rest: TGI's max concurrent requests)."""
    if kind == "deadline":
        return Admission(max_concurrency=SLOTS, max_queue=CLIENTS, deadline_s=DEADLINE_S, clock=clock)
    if kind == "none":
        return Admission(max_concurrency=SLOTS, max_queue=CLIENTS, deadline_s=None, clock=clock)
    return Admission(max_concurrency=n, max_queue=0, deadline_s=None, clock=clock)


async def saturate(seed: int, kind: str = "deadline", n: int = SLOTS) -> Outcome:
    """`CLIENTS` clients for `DURATION_S` of simulated time against a warmed-up server."""
    clock = Clock()
    simulation = Simulation(seed, policy(kind, clock, n), clock)
    await simulation.warm_up()
    start = clock.now
    simulation.end_s = start + DURATION_S
    for client in range(CLIENTS):
        simulation.schedule(start + client * RAMP_S / CLIENTS, "send", client)
    await simulation.run()
    return simulation.outcome


@pytest.mark.parametrize("seed", range(3))
async def test_under_a_saturating_load_the_accepted_finish_within_the_deadline(seed):
    outcome = await saturate(seed)
    assert outcome.refusals > len(outcome.latencies)  # far more asked than the engine can serve
    assert outcome.p99 <= DEADLINE_S and outcome.late_share <= 0.01


async def test_goodput_is_at_least_that_of_the_better_simple_policy():
    """Admitting everything serves as many, but most past the deadline; a fixed number in flight
    is right for one load at best. Admission's goodput is within 5% of the best of them."""
    deadline = await saturate(0)
    none = await saturate(0, "none")
    fixed = {n: await saturate(0, "fixed", n) for n in (2, 4, 8, 16)}
    best = max(none.goodput, *(o.goodput for o in fixed.values()))
    assert none.late_share > 0.5  # without admission most are past the deadline
    assert deadline.goodput >= 0.95 * best, (deadline.goodput, none.goodput, {n: o.goodput for n, o in fixed.items()})


@pytest.mark.parametrize("burst", [8, 16])
async def test_a_burst_that_fits_is_admitted_whole_on_a_warmed_idle_server(burst):
    """Right after start-up (the warm-up measured the rate), a burst that the engine finishes
    within the deadline is admitted whole (8 here); of a bigger one (16, whose prefills alone
    take half the deadline on this engine) what is admitted finishes within it."""
    clock = Clock()
    simulation = Simulation(0, policy("deadline", clock), clock)
    await simulation.warm_up()
    simulation.resend = False
    for client in range(burst):
        await simulation.send(client)
    await simulation.run()
    answered = simulation.outcome.latencies
    assert max(answered) <= DEADLINE_S and len(answered) >= 8
    if burst == 8:
        assert simulation.outcome.refusals == 0
