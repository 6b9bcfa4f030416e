"""Admission under a saturating load, on a simulated clock: 64 clients, each sending its next
question as soon as it has an answer (or once the `Retry-After` of a 429 has passed), against a
model of the transformers engine. What a user relies on: the accepted requests finish within the
deadline 99 times in 100, and the server is not kept idle by refusals.

The engine is continuous batching as `pipelines/engines/transformers.py` does it: between two
decode steps the prompts that arrived are prefilled, holding up every row; then one step decodes
a token for every row, and a row leaves when its answer is done. A step takes
`STEP_S + ROW_S * rows + PREFILL_S * prompt tokens`, so a batch serves more per second than one
row alone, and a burst of arrivals stalls the rows already running. Answers stop at a random
length up to `max_tokens`. Nothing here measures time; every number is of the simulated clock.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from dataclasses import dataclass, field

import pytest

from telerag.server.admission import Admission, RequestCost, Ticket
from telerag.server.errors import Overloaded

STEP_S, ROW_S, PREFILL_S = 0.08, 0.02, 0.002  # about the embedded Gemma on two cores
SLOTS, CLIENTS, DURATION_S, RAMP_S, DEADLINE_S, MAX_TOKENS = 16, 64, 300.0, 10.0, 30.0, 32


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


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


async def saturate(seed: int, deadline_s: float | None) -> Outcome:
    """Run the clients for `DURATION_S` of simulated time; what came back."""
    rng, clock, outcome = random.Random(seed), Clock(), Outcome()
    admission = Admission(max_concurrency=SLOTS, max_queue=CLIENTS, deadline_s=deadline_s, clock=clock)
    events: list[tuple[float, int, str, int]] = []  # (when, order, "send" | "step", client)
    order = itertools.count()
    running: list[Request] = []  # in the engine's batch
    stepping: list[Request] = []  # those the step in progress serves
    waiting: list[Request] = []  # admitted, no slot yet

    def schedule(when: float, kind: str, client: int = -1) -> None:
        heapq.heappush(events, (when, next(order), kind, client))

    def step() -> None:
        """Start the next step with the rows running now (prefilling those that just joined)."""
        stepping[:] = running
        if stepping:
            prefill = sum(r.prompt_tokens for r in stepping if not r.prefilled)
            schedule(clock.now + STEP_S + ROW_S * len(stepping) + PREFILL_S * prefill, "step")

    async def take_slot(request: Request) -> None:
        await admission.start(request.ticket)  # a slot is free: returns at once
        running.append(request)
        if not stepping:
            step()

    for client in range(CLIENTS):
        schedule(client * RAMP_S / CLIENTS, "send", client)
    while events:
        clock.now, _, kind, client = heapq.heappop(events)
        if kind == "send" and clock.now < DURATION_S:
            prompt_tokens = rng.randint(430, 500)
            try:
                ticket = admission.admit(RequestCost(prompt_tokens=prompt_tokens, max_tokens=MAX_TOKENS, llm_calls=1))
            except Overloaded as refused:
                outcome.refusals += 1
                schedule(clock.now + refused.retry_after, "send", client)
                continue
            request = Request(ticket, client, clock.now, prompt_tokens, tokens_left=rng.randint(5, MAX_TOKENS))
            if len(running) < SLOTS:
                await take_slot(request)
            else:
                waiting.append(request)
        elif kind == "step":
            for request in stepping:
                if not request.prefilled:
                    request.prefilled = True
                    continue
                request.tokens += 1
                request.tokens_left -= 1
                if request.tokens_left == 0:
                    running.remove(request)
                    admission.finish(request.ticket, completed=True, tokens_generated=request.tokens)
                    outcome.latencies.append(clock.now - request.sent_at)
                    schedule(clock.now, "send", request.client)
                    if waiting:
                        await take_slot(waiting.pop(0))
            step()
    return outcome


@pytest.mark.parametrize("seed", range(3))
async def test_under_a_saturating_load_the_accepted_finish_within_the_deadline(seed):
    outcome = await saturate(seed, DEADLINE_S)
    assert outcome.refusals > len(outcome.latencies)  # far more asked than the engine can serve
    assert outcome.p99 <= DEADLINE_S and outcome.late_share <= 0.01


async def test_refusals_do_not_leave_the_server_idle():
    """Against no deadline (all 64 admitted, most waiting minutes), admission costs few answers:
    its Retry-After brings clients back when there is room."""
    unbounded = await saturate(0, None)
    assert unbounded.late_share > 0.5  # without admission most are past the deadline
    bounded = await saturate(0, DEADLINE_S)
    assert len(bounded.latencies) >= 0.7 * len(unbounded.latencies)
