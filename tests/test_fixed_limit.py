"""The `fixed` admission policy (`scheduler.admission: fixed`): at most max_concurrency running
and max_queue waiting, first come first served, the rest refused at once with a 429; no
deadline, so an answer is never cut at one; chosen in the settings and served through the HTTP
API like the default."""

from __future__ import annotations

import asyncio

import pytest

from telerag.config.settings import SchedulerSettings
from telerag.server.admission.deadline import DeadlineAdmission
from telerag.server.admission.policy import FixedLimit, admission_policy
from telerag.server.admission.workload import RequestCost
from telerag.server.errors import Overloaded, Refusal, status_of
from tests.fakes import Reply, ScriptedEngine
from tests.test_admission import app_client, refusals

COST = RequestCost(work=100.0)


def fixed(**options) -> tuple[FixedLimit, list[Refusal]]:
    refused: list[Refusal] = []
    return FixedLimit(**{"max_concurrency": 2, "max_queue": 1, **options}, on_refuse=refused.append), refused


async def test_the_settings_choose_the_policy():
    callbacks = {"on_change": lambda w, r: None, "on_refuse": lambda reason: None, "on_start": lambda s: None}
    assert isinstance(admission_policy(SchedulerSettings(), **callbacks), DeadlineAdmission)
    chosen = admission_policy(SchedulerSettings(admission="fixed", max_concurrency=3, max_queue=5), **callbacks)
    assert isinstance(chosen, FixedLimit) and (chosen.max_concurrency, chosen.max_queue, chosen.deadline_s) == (3, 5, None)


async def test_past_the_running_and_waiting_limits_a_request_is_refused_at_once():
    policy, refused = fixed()
    tickets = [policy.admit(COST) for _ in range(3)]  # two to run, one to wait
    with pytest.raises(Overloaded) as caught:
        policy.admit(COST)
    assert caught.value.reason is Refusal.QUEUE_FULL and status_of(caught.value) == 429 and refused == [Refusal.QUEUE_FULL]
    for ticket in tickets[:2]:
        await policy.start(ticket)
    waiting = asyncio.create_task(policy.start(tickets[2]))
    await asyncio.sleep(0)
    assert not waiting.done() and (policy.n_running, policy.n_waiting) == (2, 1)
    policy.finish(tickets[0], completed=True)
    await waiting  # the slot freed is the waiting one's
    assert (policy.n_running, policy.n_waiting) == (2, 0)
    policy.admit(COST)  # a place in the queue again


async def test_one_api_key_has_at_most_its_limit_admitted():
    policy, refused = fixed(max_queue=8, max_in_flight_per_key=1)
    policy.admit(COST, "alpha")
    with pytest.raises(Overloaded) as caught:
        policy.admit(COST, "alpha")
    assert caught.value.reason is Refusal.KEY_LIMIT and refused == [Refusal.KEY_LIMIT]
    policy.admit(COST, "beta")


async def test_a_cancelled_wait_and_a_finish_twice_leave_nothing_behind_and_drain_ends():
    policy, _ = fixed(max_concurrency=1)
    running, queued = policy.admit(COST), policy.admit(COST)
    await policy.start(running)
    waiting = asyncio.create_task(policy.start(queued))
    await asyncio.sleep(0)
    waiting.cancel()
    await asyncio.gather(waiting, return_exceptions=True)
    assert (policy.n_running, policy.n_waiting) == (1, 0)
    drained = asyncio.create_task(policy.drain())
    await asyncio.sleep(0)
    assert not drained.done()
    policy.finish(running, completed=False)
    policy.finish(running, completed=True)
    await asyncio.wait_for(drained, 1)


async def test_through_the_api_a_fixed_limit_refuses_past_it_and_sets_no_deadline():
    engine = ScriptedEngine(lambda prompt: Reply("slow answer"), delay=0.3)
    client, app = app_client(engine, scheduler={"admission": "fixed", "max_concurrency": 1, "max_queue": 0})
    body = {"query": "q?"}
    async with client:
        first = asyncio.create_task(client.post("/v1/rag/query", json=body))
        await asyncio.sleep(0.1)
        second = await client.post("/v1/rag/query", json=body)
        answered = await first
        metrics = (await client.get("/metrics")).text
    assert second.status_code == 429 and second.json()["error"]["type"] == "queue_full"
    assert answered.status_code == 200 and answered.json()["answer"] == "slow answer"
    assert refusals(metrics, "queue_full") == 1
    assert app.state.service.admission.deadline_s is None
