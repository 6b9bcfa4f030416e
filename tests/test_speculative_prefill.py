"""Speculative prefill: the search's provisional top-k (faiss's half scanned
chunk by chunk, the answer unchanged, over random datastores with and without a device half),
the stability rule, and the pipelines prefilling the next call's prompt from it on the scripted
engine: the same calls and answers as without it, the prompt the call sends prefilled, a changed
top-k counted as a re-prefill, the request's counts in the HTTP response and /metrics; refused on
an engine that cannot prefill."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from telerag.pipelines.registry import build_pipelines
from telerag.pipelines.speculation import StableTopK
from telerag.pipelines.stats import SearchStats, SpeculationSummary
from telerag.pipelines.types import RetrievedPassage
from telerag.retrieval.codecs import Codec
from telerag.retrieval.engine import RetrievalEngine
from telerag.retrieval.provisional import Provisional, ProvisionalWatch, chunk_bounds
from tests.fake_app import Harness
from tests.fakes import RecordingRetriever, Reply, ScriptedEngine
from tests.retrieval_helpers import DEVICES, assert_same_as_faiss, random_datastore, random_queries
from tests.scripted_pipelines import SURE, UNSURE, run, script

QUESTION = "How long is the Nile?"


def test_the_chunks_end_at_a_64th_of_the_lists_then_each_at_twice_the_one_before_up_to_half():
    assert chunk_bounds(256) == [0, 4, 8, 16, 32, 64, 128, 256]
    assert chunk_bounds(128) == [0, 2, 4, 8, 16, 32, 64, 128]
    assert chunk_bounds(32) == [0, 1, 2, 4, 8, 16, 32]
    assert chunk_bounds(8) == [0, 1, 2, 4, 8]
    assert chunk_bounds(3) == [0, 1, 2, 3]
    assert chunk_bounds(1) == [0, 1]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("codec", [Codec.FP32, Codec.SQ8])
@pytest.mark.parametrize("seed", range(3))
def test_a_search_reporting_its_top_k_so_far_returns_what_faiss_does(tmp_path, device, codec, seed):
    """With and without a cluster cache (a device half on the CPU), prefetched or not: the answer
    is faiss's, and each report's i-th score is at most the final i-th (a top-k over fewer lists),
    over more of the lists each time, never all of them."""
    rng = np.random.default_rng(seed)
    nlist = int(rng.integers(8, 48))
    ds = random_datastore(tmp_path / "ds", n=int(rng.integers(800, 3000)), dim=24, nlist=nlist, codec=codec, seed=seed)
    queries = random_queries(5, ds.dim, seed)
    for cache_bytes in (0, int(ds.vectors.nbytes) // 3):
        engine = RetrievalEngine(ds, device=device, cache_bytes=cache_bytes)
        for nprobe in sorted({1, 4, nlist // 2, nlist}):
            handle = engine.prefetch(queries, int(ds.vectors.nbytes) // 4) if cache_bytes else None
            reports: list[Provisional] = []
            k = int(rng.integers(1, 12))
            watch = ProvisionalWatch(reports.append)
            result = assert_same_as_faiss(engine, queries, k=k, nprobe=nprobe, prefetch=handle, watch=watch)
            shares = [r.lists_share for r in reports]
            assert shares == sorted(shares) and all(0 < s < 1 for s in shares), shares
            if nprobe >= 4 and not cache_bytes:
                assert len(reports) == len(chunk_bounds(nprobe)) - 2  # after every chunk but the last
            for report in reports:
                valid = report.ids >= 0
                assert np.all(report.scores[valid] <= result.scores[valid] + 1e-6)
            if handle is not None:
                handle.release()
        engine.close()


def test_a_top_k_is_stable_once_a_report_repeats_the_one_before_complete():
    rule = StableTopK()
    assert not rule.offer(np.array([[1, 2, 3]]))
    assert not rule.offer(np.array([[1, 3, 2]]))  # moved
    assert rule.offer(np.array([[1, 3, 2]]))
    assert not rule.offer(np.array([[1, 3, 2]]))  # once
    incomplete = StableTopK()
    assert not incomplete.offer(np.array([[4, -1]])) and not incomplete.offer(np.array([[4, -1]]))


class ShiftingRetriever(RecordingRetriever):
    """Reports a provisional top-k whose last document is not the final one."""

    def provisional_documents(self, documents: list[list[RetrievedPassage]]) -> list[list[RetrievedPassage]]:
        return [[*group[:-1], RetrievedPassage(9_999, "other", "Other", "about something else", 0.1)] for group in documents]


def speculating(name: str, retriever: RecordingRetriever | None = None, **script_args):
    log: list = []
    engine = ScriptedEngine(script(**script_args), log)
    retriever = retriever or RecordingRetriever(log)
    retriever.log = log
    return build_pipelines(engine, retriever, names=[name])[name], engine, retriever, log


def speculative(result) -> list:
    return [s.stats.speculative for s in result.steps if isinstance(s.stats, SearchStats) and s.stats.speculative]


FLARE_ARGS = {"flare_logprobs": [(SURE, SURE, UNSURE, SURE)] * 8}


@pytest.mark.parametrize("name", ["naive", "hyde", "subquestion", "iterative", "iter_retgen", "flare", "self_rag"])
async def test_the_call_after_each_search_sends_the_prompt_prefilled_for_it_and_the_run_is_unchanged(name):
    """Every LLM call and search of the run as without speculative prefill, the same answer; each
    search's next call sends exactly the prompt prefilled during the search, and finds all of it
    but its last token cached."""
    args = {**FLARE_ARGS} if name == "flare" else {"judge": "no"}
    runs = []
    for on in (False, True):
        pipeline, engine, retriever, log = speculating(name, **args)
        result, _ = await run(pipeline, QUESTION, max_tokens=8, speculative_prefill=on)
        runs.append(([e for e in log if e[0] != "prefill"], retriever.searches, result.answer, result.documents))
        reports = speculative(result)
        if not on:
            assert engine.prefilled == [] and reports == [] and result.speculation == SpeculationSummary()
            continue
        assert len(engine.prefilled) == len(retriever.searches) == len(reports) > 0
        assert set(engine.prefilled) <= set(engine.prompts)  # each is a prompt the run then sent
        assert all(not r.reprefilled and r.lists_share == 0.25 for r in reports)
        assert all(r.reused_tokens == r.prefilled_tokens - 1 for r in reports if r.prefilled_tokens)
        assert result.speculation.prefills == len(reports) and result.speculation.reprefilled == 0
        assert result.speculation.reused_tokens > 0
    assert runs[0] == runs[1]


async def test_a_changed_top_k_is_prefilled_again_from_the_document_that_changed():
    pipeline, engine, _, _ = speculating("naive", ShiftingRetriever())
    result, _ = await run(pipeline, QUESTION, max_tokens=8, speculative_prefill=True)
    (report,) = speculative(result)
    assert report.reprefilled and report.prefilled_tokens and 0 < report.reused_tokens < report.prefilled_tokens
    assert engine.prefilled[0] not in engine.prompts  # the call was built from the final top-k
    assert result.speculation == SpeculationSummary(1, 1, report.prefilled_tokens, report.reused_tokens)
    assert all(d.id != 9_999 for d in result.documents)


async def test_a_speculative_prefill_still_waiting_when_the_top_k_changed_is_cancelled():
    log: list = []
    engine = ScriptedEngine(script(), log, delay=0.05)
    pipeline = build_pipelines(engine, ShiftingRetriever(log), names=["naive"])["naive"]
    result, _ = await run(pipeline, QUESTION, max_tokens=8, speculative_prefill=True)
    (report,) = speculative(result)
    assert report.reprefilled and report.prefilled_tokens is None and report.reused_tokens is None
    assert engine.prefilled == []  # cancelled while it waited
    await asyncio.sleep(0)


async def test_pipelined_searches_are_not_speculated():
    """A search launched during its step's generation (`pipelining`) hides behind it already."""
    pipeline, engine, _, _ = speculating("iter_retgen", answer="The Nile is a long river in Africa")
    result, _ = await run(pipeline, QUESTION, max_tokens=8, speculative_prefill=True, pipelining=True)
    assert result.pipelining.retrievals == 2
    assert result.speculation.prefills == 1 == len(engine.prefilled)  # the first search only


async def test_the_response_and_metrics_report_the_speculative_prefills():
    harness = Harness()
    async with harness.client() as client:
        body = (await client.post("/v1/rag/query", json={"query": QUESTION, "speculative_prefill": True})).json()
        off = (await client.post("/v1/rag/query", json={"query": QUESTION})).json()
        metrics = (await client.get("/metrics")).text
    assert body["speculation"]["prefills"] == 1 and body["speculation"]["reprefilled"] == 0
    assert body["speculation"]["reused_tokens"] == body["speculation"]["prefilled_tokens"] - 1 > 0
    (search,) = [s for s in body["steps"] if s["kind"] == "retrieval"]
    assert search["stats"]["speculative"]["reprefilled"] is False
    assert off["speculation"]["prefills"] == 0 and off["answer"] == body["answer"]
    assert 'telerag_speculative_prefills_total{outcome="confirmed",pipeline="naive"} 1.0' in metrics
    assert 'telerag_speculative_prefill_tokens_total{kind="reused",pipeline="naive"}' in metrics


class EngineWithoutPrefill:
    """A scripted engine without the capability to prefill a prompt alone."""

    name = "no-prefill"

    def __init__(self) -> None:
        self.inner = ScriptedEngine(lambda prompt: Reply("Paris is the capital of France"))
        self.generate, self.stream, self.close = self.inner.generate, self.inner.stream, self.inner.close
        self.count_tokens, self.decode, self.format_prompt = self.inner.count_tokens, self.inner.decode, self.inner.format_prompt


async def test_speculative_prefill_on_an_engine_that_cannot_prefill_is_refused_and_the_rest_is_served():
    harness = Harness(engine=EngineWithoutPrefill())
    async with harness.client() as client:
        refused = await client.post("/v1/rag/query", json={"query": QUESTION, "speculative_prefill": True})
        served = await client.post("/v1/rag/query", json={"query": QUESTION})
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["type"] == "unsupported_by_engine"
    assert "speculative_prefill" in refused.json()["error"]["message"]
    assert served.status_code == 200 and served.json()["answer"]
