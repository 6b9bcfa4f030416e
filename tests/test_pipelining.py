"""Pipelined retrieval (PipeRAG) and nprobe "auto" in the iterative pipelines, on the scripted
engine (tokens are words, streamed one by one with a pause, as a real engine decodes) and the
recording retriever (hash embeddings: texts sharing words are alike)."""

from __future__ import annotations

import asyncio
import functools

import numpy as np
import openai
import pytest

from telerag.engines.errors import EngineError
from telerag.pipelines.pipelining import (
    ExpectedTokens,
    PartialGeneration,
    PipeliningConfig,
    cosines,
    launch_point,
)
from telerag.pipelines.registry import build_pipelines
from telerag.pipelines.search_budget import SearchBudget
from telerag.pipelines.stats import PipeliningSummary, SearchStats
from telerag.pipelines.types import RunOptions, StageEvent, event_stream
from tests.fake_app import Harness, sdk
from tests.fakes import RecordingRetriever, ScriptedEngine
from tests.scripted_pipelines import SURE, UNSURE, run, script

ANSWER = "The Nile is a long river in Africa"  # 8 words: 8 tokens
QUESTION = "How long is the Nile?"


class OptionsRecorder(RecordingRetriever):
    """Also records each search's options and whether it had a prefetch ticket."""

    def __init__(self, log=None, **kwargs) -> None:
        super().__init__(log, **kwargs)
        self.options: list = []
        self.tickets: list = []

    async def search(self, queries, options, ticket=None):
        self.options.append(options)
        self.tickets.append(ticket)
        return await super().search(queries, options, ticket)


def pipelined(name: str, config: PipeliningConfig | None = None, budget: SearchBudget | None = None, **script_args):
    log: list = []
    engine = ScriptedEngine(script(**script_args), log, token_delay=0.002)
    retriever = OptionsRecorder(log)
    pipeline = build_pipelines(engine, retriever, names=[name], pipelining=config, search_budget=budget)[name]
    return pipeline, engine, retriever, log


def searches(result):
    return [s for s in result.steps if s.kind == "retrieval"]


async def test_iter_retgen_searches_the_answer_so_far_while_the_round_is_written():
    """Rounds 2 and 3 search from half of the round's answer (its expected 8 tokens: 4), and
    the search starts before the round's LLM call ends; alike enough, its documents are used."""
    pipeline, _engine, retriever, log = pipelined("iter_retgen", PipeliningConfig(min_cosine=-1.0, check=False), answer=ANSWER)
    result, _ = await run(pipeline, QUESTION, max_tokens=8, pipelining=True)
    stale = f"{QUESTION} The Nile is a"
    assert retriever.searches == [[QUESTION], [stale], [stale]]
    kinds = [k for k, _ in log]
    first_round = kinds.index("llm_start", 0)
    assert kinds.index("search", first_round) < kinds.index("llm_end", first_round)  # launched mid-generation
    launched = searches(result)[1:]
    assert all(s.stats.pipelined is not None and s.stats.pipelined.launched_after_tokens == 4 for s in launched)
    assert result.pipelining == PipeliningSummary(retrievals=2, searched_again=0, checked=0, differed=0)
    assert result.documents and all(d.text == f"about {stale}" for d in result.documents)
    assert not retriever.outstanding


async def test_a_final_query_too_far_from_the_stale_one_is_searched_again():
    pipeline, _engine, retriever, _log = pipelined("iter_retgen", PipeliningConfig(min_cosine=0.99), answer=ANSWER)
    result, _ = await run(pipeline, QUESTION, max_tokens=8, pipelining=True)
    stale, final = f"{QUESTION} The Nile is a", f"{QUESTION} {ANSWER}"
    assert retriever.searches == [[QUESTION], [stale], [final], [stale], [final]]
    assert all(d.text == f"about {final}" for d in result.documents)  # the final query's documents answer
    reports = [s.stats.pipelined for s in searches(result) if s.stats.pipelined is not None]
    assert [r.searched_again for r in reports] == [True, True]
    assert all(r.cosine < 0.99 and r.same_documents is False for r in reports)
    assert result.pipelining == PipeliningSummary(retrievals=2, searched_again=2, checked=2, differed=2)


async def test_kept_stale_documents_are_checked_against_the_final_query_beside_the_run():
    pipeline, _engine, retriever, _log = pipelined("iter_retgen", PipeliningConfig(min_cosine=-1.0, check=True), answer=ANSWER)
    result, _ = await run(pipeline, QUESTION, max_tokens=8, pipelining=True)
    final = f"{QUESTION} {ANSWER}"
    assert retriever.searches.count([final]) == 2  # the checks: searched, but not traced as the run's searches
    assert len(searches(result)) == 3
    assert result.pipelining == PipeliningSummary(retrievals=2, searched_again=0, checked=2, differed=2)


async def test_the_same_answer_so_far_as_the_final_one_is_reported_unchanged():
    """A round whose answer is complete at the launch point: stale query = final query."""
    pipeline, _engine, _retriever, _log = pipelined("iter_retgen", PipeliningConfig(launch_share=1.0), answer=ANSWER)
    result, _ = await run(pipeline, QUESTION, max_tokens=8, pipelining=True)
    reports = [s.stats.pipelined for s in searches(result) if s.stats.pipelined is not None]
    assert [r.cosine for r in reports] == pytest.approx([1.0, 1.0])
    assert result.pipelining == PipeliningSummary(retrievals=2, searched_again=0, checked=2, differed=0)


@pytest.mark.parametrize("name", ["iter_retgen", "iterative", "flare", "self_rag", "naive"])
async def test_without_pipelining_a_run_is_the_sequential_one(name):
    """A request without `pipelining` runs exactly as before, whatever the pipelines' config:
    the same calls in the same order, the same searches and answer, nothing reported."""
    args = {"flare_logprobs": [(SURE, SURE, UNSURE, SURE)] * 8} if name == "flare" else {"judge": "no"}
    runs = []
    for config in (None, PipeliningConfig(launch_share=0.0, min_cosine=-1.0)):
        pipeline, _engine, retriever, log = pipelined(name, config, answer=ANSWER, **args)
        result, _ = await run(pipeline, QUESTION, max_tokens=8)
        runs.append((log, retriever.searches, result.answer, [s.stage.name for s in result.steps]))
        assert result.pipelining == PipeliningSummary()
        assert all(s.stats.pipelined is None for s in searches(result))
    assert runs[0] == runs[1]


async def test_flare_launches_at_an_unsure_token_past_the_launch_point():
    """FLARE's first look-ahead (no expected length yet: its limit of 40) searches after it; the
    next ones (4 tokens expected) launch at their unsure third token, with the sure ones so far."""
    logprobs = [(SURE, SURE, UNSURE, SURE)] * 8
    config = PipeliningConfig(min_cosine=-1.0, check=False)
    pipeline, _engine, retriever, _log = pipelined("flare", config, flare_logprobs=logprobs)
    result, _ = await run(pipeline, QUESTION, max_tokens=12, pipelining=True)
    assert retriever.searches[0] == [f"{QUESTION} The Nile north"]  # after the look-ahead: "flows" masked
    assert retriever.searches[1:] and all(s == [f"{QUESTION} The Nile"] for s in retriever.searches[1:])  # at "flows"
    assert result.pipelining.retrievals == len(retriever.searches) - 1


async def test_flare_launches_nothing_for_a_sure_sentence():
    pipeline, _engine, retriever, _log = pipelined("flare", flare_logprobs=[(SURE,) * 4] * 6)
    result, _ = await run(pipeline, QUESTION, max_tokens=12, pipelining=True)
    assert retriever.searches == [] and result.pipelining == PipeliningSummary()


async def test_iterative_searches_its_narrower_question_so_far():
    pipeline, _engine, retriever, _log = pipelined("iterative", PipeliningConfig(min_cosine=-1.0, check=False), judge="no")
    result, _ = await run(pipeline, QUESTION, max_tokens=8, pipelining=True)
    # "Nile length": 2 tokens, half of which is "Nile"; the first iteration knows no length yet
    assert [str(q) for q in retriever.searches[0]] == [f"{QUESTION} + Nile length"]
    assert [str(q) for q in retriever.searches[1]] == [f"{QUESTION} + Nile"]
    assert result.pipelining.retrievals == 2


async def test_a_named_nprobe_is_used_by_every_search_of_a_pipelined_run():
    pipeline, _engine, retriever, _log = pipelined("iter_retgen", PipeliningConfig(min_cosine=0.99), answer=ANSWER)
    await run(pipeline, QUESTION, max_tokens=8, pipelining=True, nprobe=7)
    assert [o.nprobe for o in retriever.options] == [7] * 5


async def test_nprobe_auto_fits_the_pipelined_search_in_the_generation_left():
    """A pipelined search's nprobe comes from the model and the generation predicted left; the
    searches that overlap nothing run at the default nprobe (None)."""
    budget = SearchBudget(floor=2, ceiling=lambda: 1000)
    for nprobe in (10, 20, 40):  # 1 ms a list, nothing fixed
        budget.observe(nprobe, 0, float(nprobe))
    pipeline, _engine, retriever, _log = pipelined(
        "iter_retgen", PipeliningConfig(min_cosine=-1.0, check=False), budget=budget, answer=ANSWER
    )
    result, _ = await run(pipeline, QUESTION, max_tokens=8, pipelining=True, nprobe="auto")
    chosen = [o.nprobe for o in retriever.options]
    assert chosen[0] is None  # the first search has no generation beside it
    reports = [s.stats.pipelined for s in searches(result)[1:]]
    assert all(r.budget_ms is not None and r.budget_ms > 0 for r in reports)
    # 4 tokens left at the decode rate measured so far; the fake's searches teach the model too
    assert all(isinstance(n, int) and 2 <= n <= 1000 for n in chosen[1:])


async def test_the_stale_search_waits_for_the_prefetch_and_uses_its_ticket():
    pipeline, _engine, retriever, _log = pipelined("iter_retgen", PipeliningConfig(min_cosine=-1.0, check=False), answer=ANSWER)
    await run(pipeline, QUESTION, max_tokens=8, pipelining=True)
    assert all(t is not None for t in retriever.tickets)
    assert [t.queries for t in retriever.tickets[1:]] == [[QUESTION], [f"{QUESTION} {ANSWER}"]]


@pytest.mark.parametrize("name", ["iter_retgen", "iterative", "flare"])
async def test_a_cancelled_pipelined_run_releases_its_prefetches_and_searches(name):
    log: list = []
    retriever = RecordingRetriever(log)
    engine = ScriptedEngine(script(judge="no", flare_logprobs=[(SURE, UNSURE)] * 8), log, token_delay=0.05)
    pipeline = build_pipelines(engine, retriever, names=[name])[name]
    stream = event_stream(functools.partial(pipeline.run, QUESTION, RunOptions(max_tokens=4, pipelining=True)))
    assert isinstance(await stream.__anext__(), StageEvent)
    await asyncio.sleep(0.3)
    await stream.aclose()
    assert retriever.prefetches and not retriever.outstanding
    assert not [t for t in asyncio.all_tasks() if t is not asyncio.current_task() and not t.done()]


@pytest.mark.parametrize("name", ["iter_retgen", "iterative", "flare"])
async def test_an_engine_error_in_a_pipelined_run_reaches_the_caller_and_releases(name):
    log: list = []
    retriever = RecordingRetriever(log)
    pipeline = build_pipelines(ScriptedEngine(script(), log, fail=True), retriever, names=[name])[name]
    with pytest.raises(EngineError):
        await run(pipeline, QUESTION, pipelining=True)
    assert not retriever.outstanding


# -- the parts ----------------------------------------------------------------------------------


def partial(words: int, expected: float, per_token_ms: float | None = 10.0) -> PartialGeneration:
    return PartialGeneration(" ".join(["w"] * words), tuple(range(words)), (0.0,) * words, expected, per_token_ms)


def test_the_launch_point_is_a_share_of_the_expected_tokens():
    stale = lambda p: [p.text]  # noqa: E731
    assert launch_point(partial(3, 8.0), stale, 0.5, now=1.0) is None
    launch = launch_point(partial(4, 8.0), stale, 0.5, now=1.0)
    assert launch is not None and launch.tokens == 4 and launch.left_ms == pytest.approx(40.0) and launch.at == 1.0
    assert launch_point(partial(4, 8.0, per_token_ms=None), stale, 0.5, now=1.0).left_ms is None
    assert launch_point(partial(1, 8.0), stale, 0.0, now=1.0) is not None  # at least one token
    assert launch_point(partial(5, 8.0), lambda p: None, 0.5, now=1.0) is None  # no query yet
    assert launch_point(partial(5, 8.0), lambda p: ["  "], 0.5, now=1.0) is None  # a blank one is none


def test_expected_tokens_start_at_the_limit_and_follow_the_calls():
    expected = ExpectedTokens()
    assert expected.of("round", 32) == 32.0
    expected.observe("round", 10)
    assert expected.of("round", 32) == 10.0 and expected.of("round", 6) == 6.0
    expected.observe("round", 20)
    assert expected.of("round", 32) == pytest.approx(12.0)


def test_cosines_pair_queries_and_take_the_least():
    a = np.array([[1.0, 0.0], [0.0, 1.0]], dtype=np.float32)
    b = np.array([[1.0, 0.0], [1.0, 1.0]], dtype=np.float32)
    assert cosines(a, b) == pytest.approx(2**-0.5)
    assert cosines(a, b[:1]) == -1.0


def test_pipelining_config_is_checked():
    with pytest.raises(ValueError, match="launch_share"):
        PipeliningConfig(launch_share=1.5)
    with pytest.raises(ValueError, match="min_cosine"):
        PipeliningConfig(min_cosine=2.0)


def test_the_search_budget_fits_a_linear_law_and_picks_the_largest_nprobe_within_budget():
    lists = [512]
    budget = SearchBudget(floor=4, ceiling=lambda: lists[0])
    assert budget.choose(100.0) is None  # nothing observed yet: the default
    for nprobe, depth in [(8, 0), (16, 0), (32, 1), (64, 0), (128, 2), (16, 3)]:
        budget.observe(nprobe, depth, 2.0 + 0.5 * nprobe + 3.0 * depth)
    fit = budget.fit()
    assert (fit.fixed_ms, fit.per_list_ms, fit.per_queued_ms) == pytest.approx((2.0, 0.5, 3.0), rel=0.02)
    assert budget.choose(52.25) == 100  # (52.25 - 2) / 0.5, rounded down
    assert budget.choose(1.0) == 4  # never below the floor
    assert budget.choose(1e6) == 512  # nor above the ceiling (nlist)
    lists[0] = 64
    assert budget.choose(1e6) == 64  # the ceiling as a retrain left it, read at each choice
    lists[0] = 512
    with budget.searching(), budget.searching():  # two in flight: 6 ms of the budget is theirs
        assert budget.choose(52.25) == 88


def test_with_one_nprobe_seen_the_budget_takes_time_as_proportional_to_it():
    budget = SearchBudget(floor=1, ceiling=lambda: 1000)
    budget.observe(0, 0, 50.0)  # nprobe unknown (a retriever that does not say): ignored
    assert budget.choose(10.0) is None
    for _ in range(5):
        budget.observe(64, 0, 32.0)
    assert budget.fit().per_list_ms == pytest.approx(0.5, rel=1e-3)
    assert budget.choose(16.1) == 32
    assert SearchBudget(ceiling=lambda: None).choose(10.0) is None  # no ceiling known: the default


def test_searches_are_counted_in_flight():
    budget = SearchBudget()
    with budget.searching() as first, budget.searching() as second:
        assert (first, second, budget.in_flight) == (0, 1, 2)
    assert budget.in_flight == 0


def test_search_stats_default_to_no_pipelining():
    assert SearchStats().pipelined is None


# -- over HTTP ----------------------------------------------------------------------------------


async def test_a_query_may_ask_for_pipelining_and_nprobe_auto():
    h = Harness()
    body = {"query": "Capital of France?", "pipeline": "iter_retgen", "max_tokens": 6, "pipelining": True, "nprobe": "auto"}
    async with h.client() as client:
        on = (await client.post("/v1/rag/query", json=body)).json()
        off = (await client.post("/v1/rag/query", json={**body, "pipelining": False})).json()
        metrics = (await client.get("/metrics")).text
    assert on["pipelining"]["retrievals"] == 2 and off["pipelining"] == {
        "retrievals": 0,
        "searched_again": 0,
        "checked": 0,
        "differed": 0,
    }
    pipelined = [s["stats"]["pipelined"] for s in on["steps"] if s["kind"] == "retrieval" and s["stats"]["pipelined"]]
    assert len(pipelined) == 2 and all(p["launched_after_tokens"] == 3 for p in pipelined)
    assert 'telerag_pipelined_retrievals_total{outcome="' in metrics and 'pipeline="iter_retgen"' in metrics
    assert not h.retriever.outstanding


async def test_nprobe_auto_reports_its_choice_in_the_trace_and_the_metrics():
    h = Harness()
    body = {"query": "Capital of France?", "pipeline": "iter_retgen", "max_tokens": 6, "pipelining": True, "nprobe": "auto"}
    async with h.client() as client:
        for _ in range(2):  # the first teaches the search-time model (8 lists at the fake's pace)
            result = (await client.post("/v1/rag/query", json=body)).json()
        metrics = (await client.get("/metrics")).text
    budgeted = [s["stats"] for s in result["steps"] if s["kind"] == "retrieval" and s["stats"]["pipelined"]]
    assert budgeted and all(s["pipelined"]["budget_ms"] is not None and 1 <= s["nprobe"] <= 64 for s in budgeted)
    assert "telerag_auto_nprobe_count" in metrics


@pytest.mark.parametrize(("fields", "field"), [({"nprobe": "many"}, "nprobe"), ({"pipelining": 1}, "pipelining")])
async def test_a_bad_pipelining_or_nprobe_is_422_naming_it(fields, field):
    h = Harness()
    async with h.client() as client:
        response = await client.post("/v1/rag/query", json={"query": "q", **fields})
    assert response.status_code == 422 and response.json()["error"]["field"] == field


async def test_the_settings_give_a_request_its_default_pipelining_and_nprobe():
    h = Harness(retrieval={"nprobe": "auto"}, experiments={"pipelining": True})
    body = {"query": "Capital of France?", "pipeline": "iter_retgen", "max_tokens": 6}
    async with h.client() as client:
        default = (await client.post("/v1/rag/query", json=body)).json()
        declined = (await client.post("/v1/rag/query", json={**body, "pipelining": False, "nprobe": 5})).json()
    assert default["pipelining"]["retrievals"] == 2 and declined["pipelining"]["retrievals"] == 0
    assert {s["stats"]["nprobe"] for s in declined["steps"] if s["kind"] == "retrieval"} == {5}


async def test_the_openai_routes_refuse_pipelining_by_name_and_run_with_the_settings():
    h = Harness(experiments={"pipelining": True})
    async with h.client() as http:
        with pytest.raises(openai.BadRequestError) as refused:
            await sdk(http).chat.completions.create(
                model="iter_retgen", messages=[{"role": "user", "content": "Capital?"}], extra_body={"pipelining": False}
            )
        completion = await sdk(http).chat.completions.create(
            model="iter_retgen", messages=[{"role": "user", "content": "Capital?"}], max_tokens=6
        )
        metrics = (await http.get("/metrics")).text
    assert refused.value.status_code == 400 and refused.value.param == "pipelining"
    assert completion.choices[0].message.content
    assert 'telerag_pipelined_retrievals_total{outcome="kept",pipeline="iter_retgen"}' in metrics or (
        'telerag_pipelined_retrievals_total{outcome="searched_again",pipeline="iter_retgen"}' in metrics
    )
