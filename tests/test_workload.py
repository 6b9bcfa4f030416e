"""A request's expected cost: from what its pipeline's requests were served lately (a high
quantile, its answers cut at its own max_tokens, its prompts scaled to its own), with a stated
prior until enough are measured; and the work a request was served, read from its trace."""

from __future__ import annotations

import pytest

from telerag.pipelines.rag.base import GENERATE, PREFETCH, SEARCH
from telerag.pipelines.rag.self_rag import CRITIQUE, DECIDE_RETRIEVAL
from telerag.pipelines.stats import GenerationStats, PrefetchSummary, Timings
from telerag.pipelines.types import RagResult, Step
from telerag.server.admission.workload import (
    FEW_SAMPLES_SPREAD,
    PREFILL_WEIGHT,
    PRIOR_CALL_TOKENS,
    PROFILE_MIN_SAMPLES,
    CallOutput,
    RequestCost,
    ServedWork,
    Workload,
)
from tests.scripted_pipelines import make, run

W = PREFILL_WEIGHT  # a prompt token's work


def served(prompt: int, *outputs: tuple[int, bool]) -> ServedWork:
    return ServedWork(prompt, tuple(CallOutput(tokens, answer) for tokens, answer in outputs))


def test_the_served_work_is_read_from_the_trace_each_llm_call_with_its_prompt():
    steps = [
        Step(PREFETCH, "q", ms=1.0),
        Step(DECIDE_RETRIEVAL, "q", tokens_in=50, tokens_out=2),
        Step(SEARCH, "q"),
        Step(CRITIQUE, "q", tokens_in=400, tokens_out=3),
        Step(GENERATE, "q", tokens_in=450, tokens_out=30),
    ]
    result = RagResult("a", "self_rag", [], steps, Timings(), PrefetchSummary())
    work = ServedWork.of(result)
    assert work == served(900, (2, False), (3, False), (30, True))
    assert work.work == pytest.approx(W * 900 + 35)


def test_prompt_tokens_the_prefix_cache_held_are_not_counted_as_work():
    """A multi-call pipeline's later prompts carry the documents its first one prefilled: counted
    again, FLARE on the embedded default was costed up to 3x its time."""
    steps = [
        Step(GENERATE, "q", tokens_in=450, tokens_out=10, tokens_cached=20),
        Step(GENERATE, "q", tokens_in=470, tokens_out=12, tokens_cached=440),
    ]
    result = RagResult("a", "flare", [], steps, Timings(), PrefetchSummary())
    work = ServedWork.of(result)
    assert work.prefilled_tokens == 430 + 30
    assert work.work == pytest.approx(W * 460 + 22)


async def test_a_real_run_is_measured_with_every_call_it_made():
    pipeline, _, _, log = make("iterative", judge="no")
    result, _ = await run(pipeline)
    work = ServedWork.of(result)
    assert len(work.outputs) == sum(kind == "llm_start" for kind, _ in log)
    assert [o.answer for o in work.outputs].count(True) == 1  # the streamed answer; the drafts are the judge's


def test_before_any_is_measured_the_prior_stands_in_and_until_enough_are_the_few_with_a_wide_spread():
    """Both tentative: no reason to refuse a request alone."""
    workload = Workload()
    prior = workload.estimate("hyde", llm_calls=2, prompt_tokens=500, max_tokens=1024)
    assert prior == RequestCost(work=2 * (W * 500 + PRIOR_CALL_TOKENS), prefill_work=W * 500, tentative=True)
    assert workload.estimate("hyde", 2, 500, max_tokens=16).work == pytest.approx(2 * (W * 500 + 16))  # never past max_tokens
    workload.observe("hyde", 500, served(600, (40, False), (20, True)))  # one, as the warm-up measures
    few = workload.estimate("hyde", 2, 500, 1024)
    assert few == RequestCost(work=W * 600 + 60, prefill_work=W * 500, spread=FEW_SAMPLES_SPREAD * (W * 600 + 60), tentative=True)
    for _ in range(PROFILE_MIN_SAMPLES - 2):
        workload.observe("hyde", 500, served(600, (40, False), (20, True)))
    assert workload.estimate("hyde", 2, 500, 1024) == few
    workload.observe("hyde", 500, served(600, (40, False), (20, True)))
    measured = workload.estimate("hyde", 2, 500, 1024)
    assert measured == RequestCost(work=W * 600 + 60, prefill_work=W * 500, spread=0.0)


def test_the_estimate_is_the_mean_and_a_high_quantile_of_the_recent_work_cut_at_max_tokens_and_scaled_to_the_prompt():
    workload = Workload(window=10, quantile=0.9, min_samples=5)
    for answer in range(10, 110, 10):  # answers of 10 .. 100 tokens, prompts of 400
        workload.observe("naive", 400, served(400, (answer, True)))
    cost = workload.estimate("naive", 1, 400, 1024)
    assert cost.work == pytest.approx(W * 400 + 55) and cost.work_among(1) == pytest.approx(W * 400 + 91)  # mean; 90th percentile
    assert workload.estimate("naive", 1, 400, 32).work_among(1) == pytest.approx(W * 400 + 32)  # its own max_tokens bounds it
    assert workload.estimate("naive", 1, 800, 1024).work_among(1) == pytest.approx(W * 800 + 91)  # twice the passages
    assert workload.estimate("hyde", 2, 400, 1024).work == pytest.approx(2 * (W * 400 + PRIOR_CALL_TOKENS))  # its own pipeline's
    for _ in range(10):  # the window keeps only the last
        workload.observe("naive", 400, served(400, (10, True)))
    assert workload.estimate("naive", 1, 400, 1024).work_among(1) == pytest.approx(W * 400 + 10)


def test_among_many_a_request_counts_its_share_of_the_spread_of_their_sum():
    """n answers' lengths added spread sqrt(n) times as much as one: a burst of 9 is costed at
    the mean plus a third of the spread each, not as if every answer were long."""
    cost = RequestCost(work=60.0, spread=30.0)
    assert cost.work_among(1) == pytest.approx(90.0) and cost.work_among(9) == pytest.approx(70.0)


def test_calls_that_do_not_write_the_answer_are_not_cut_at_max_tokens():
    workload = Workload(min_samples=1)
    workload.observe("subquestion", 400, served(500, (90, False), (30, True)))  # a decomposition of 90 tokens
    assert workload.estimate("subquestion", 2, 400, max_tokens=8).work == pytest.approx(W * 500 + 90 + 8)


def test_an_answer_its_limit_cut_counts_as_running_to_a_larger_limit():
    """Answers cut at 64 tokens say only that they would have run at least 64: a request that
    allows 1024 is costed as if they had run to 1024, one that allows 32 at 32."""
    workload = Workload(window=10, quantile=0.9, min_samples=5)
    for _ in range(10):
        workload.observe("naive", 400, ServedWork(400, (CallOutput(64, answer=True, cut=True),)))
    assert workload.estimate("naive", 1, 400, 1024).work == pytest.approx(W * 400 + 1024)
    assert workload.estimate("naive", 1, 400, 32).work == pytest.approx(W * 400 + 32)
    for _ in range(10):
        workload.observe("naive", 400, served(400, (30, True)))  # ended of themselves
    assert workload.estimate("naive", 1, 400, 1024).work == pytest.approx(W * 400 + 30)


def test_the_cut_is_read_from_the_trace():
    steps = [Step(GENERATE, "q", tokens_in=450, tokens_out=64, stats=GenerationStats("length", 5.0))]
    result = RagResult("a", "naive", [], steps, Timings(), PrefetchSummary())
    assert ServedWork.of(result).outputs == (CallOutput(64, answer=True, cut=True),)


def test_an_answer_the_deadline_stopped_is_cut_as_one_its_limit_stopped():
    """Stopped at the server's deadline, an answer says only that it would have run at least as
    long; a call it skipped, nothing at all: both run to the next request's limit."""
    steps = [
        Step(CRITIQUE, "q", tokens_in=500, tokens_out=2, stats=GenerationStats("deadline", 5.0)),
        Step(GENERATE, "q", stats=GenerationStats("deadline")),
    ]
    result = RagResult("a", "self_rag", [], steps, Timings(), PrefetchSummary())
    assert ServedWork.of(result).outputs == (CallOutput(2, answer=False, cut=True), CallOutput(0, answer=True, cut=True))
    assert ServedWork.of(result).work_for(1.0, 64) == pytest.approx(W * 500 + 2 + 64)


def test_requests_sampled_hot_are_measured_apart_and_costed_at_their_limit_until_they_are():
    """Above `HOT_TEMPERATURE` answers seldom end before their limit: the greedy answers'
    lengths say nothing of them (a request at 2.0 ran its 1024 tokens for 42 s where greedy
    answers took a few seconds)."""
    workload = Workload(window=10, quantile=0.9, min_samples=5)
    for _ in range(10):
        workload.observe("naive", 400, served(400, (30, True)))
    assert workload.estimate("naive", 1, 400, 1024, temperature=0.7).work == pytest.approx(W * 400 + 30)
    hot = workload.estimate("naive", 1, 400, 1024, temperature=2.0)
    assert hot.work == pytest.approx(W * 400 + 1024) and not hot.tentative  # a bound they reach, not a guess
    for _ in range(4):
        workload.observe("naive", 400, served(400, (200, True)), temperature=1.5)
    assert workload.estimate("naive", 1, 400, 1024, temperature=2.0) == hot  # until enough are measured
    workload.observe("naive", 400, served(400, (200, True)), temperature=1.5)
    assert workload.estimate("naive", 1, 400, 1024, temperature=2.0).work == pytest.approx(W * 400 + 200)
    assert workload.estimate("naive", 1, 400, 1024).work == pytest.approx(W * 400 + 30)  # the greedy ones unchanged
