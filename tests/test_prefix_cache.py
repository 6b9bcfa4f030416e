"""The transformers engine's prefix cache: the radix tree alone (what it matches, what it keeps
within its budget), the engine with it (greedy output identical with the cache on and off, on
the tiny random Gemma 3 whose sliding window is 8 tokens, and on the embedded Gemma 3 270M over
every pipeline's real prompts), and the reuse reported: per step, in the OpenAI usage of the SDK
and LangChain, and in /metrics."""

from __future__ import annotations

import asyncio
import random
import zlib
from collections.abc import Sequence

import pytest
import torch
from langchain_openai import ChatOpenAI

from telerag.engines.transformers.engine import TransformersEngine
from telerag.engines.transformers.prefix_cache import LayerKV, PrefixCache
from telerag.engines.types import Generation, SamplingParams
from telerag.pipelines.registry import build_pipelines
from telerag.pipelines.types import RetrievedPassage, RunOptions, ignore_events
from telerag.retrieval.stats import CacheStats
from telerag.server.app import create_app, start_serving
from telerag.server.process.runtime import Runtime
from tests.fake_app import DATASTORE_INFO, sdk, settings
from tests.fakes import RecordingRetriever
from tests.tiny_models import tiny_engine

LAYERS, HEADS, DIM = 2, 1, 4
TOKEN_BYTES = LAYERS * 2 * HEADS * DIM * 4  # float32 keys and values of one token, every layer


def kv_of(ids: Sequence[int], start: int = 0) -> list[LayerKV]:
    """Made-up KV of `ids[start:]` in which each token's entry depends on the whole prefix up to
    it, as a causal model's does: equal entries mean equal prefixes."""
    rows = [float(zlib.crc32(bytes(str(ids[: i + 1]), "ascii"))) for i in range(start, len(ids))]
    keys = torch.tensor(rows).reshape(1, 1, -1, 1).expand(1, HEADS, -1, DIM).clone()
    return [(keys + layer, -keys - layer) for layer in range(LAYERS)]


def assert_kv_equal(got: list[LayerKV], expected: list[LayerKV]) -> None:
    assert len(got) == len(expected)
    for (k, v), (ek, ev) in zip(got, expected, strict=True):
        assert torch.equal(k, ek) and torch.equal(v, ev)


def test_a_prompt_matches_the_longest_prefix_inserted_with_that_prefixs_kv():
    cache = PrefixCache(budget_bytes=1 << 20)
    assert cache.match([1, 2, 3]).tokens == 0 and cache.match([1, 2, 3]).kv == []
    cache.insert([1, 2, 3, 4, 5], kv_of([1, 2, 3, 4, 5]))
    cache.insert([1, 2, 9, 9], kv_of([1, 2, 9, 9]))  # parts from the first inside its edge: split
    cache.insert([7], kv_of([7]))
    for ids, matched in (([1, 2, 3, 4, 5, 6], 5), ([1, 2, 3, 8], 3), ([1, 2, 9, 9, 9], 4), ([1, 2], 2), ([7, 1], 1), ([8], 0)):
        hit = cache.match(ids)
        assert hit.tokens == matched, ids
        if matched:
            assert_kv_equal(hit.kv, kv_of(ids[:matched]))
    assert cache.bytes == (5 + 2 + 1) * TOKEN_BYTES  # the shared [1, 2] held once


def test_a_suffix_is_inserted_after_the_prefix_it_was_computed_from():
    cache = PrefixCache(budget_bytes=1 << 20)
    cache.insert([1, 2, 3], kv_of([1, 2, 3]))
    cache.insert([1, 2, 3, 4, 5], kv_of([1, 2, 3, 4, 5], start=3), start=3)
    assert_kv_equal(cache.match([1, 2, 3, 4, 5]).kv, kv_of([1, 2, 3, 4, 5]))
    cache.insert([1, 2, 3, 4, 6], kv_of([1, 2, 3, 4, 6], start=2), start=2)  # what is held already is not added again
    assert_kv_equal(cache.match([1, 2, 3, 4, 6]).kv, kv_of([1, 2, 3, 4, 6]))
    assert cache.bytes == 6 * TOKEN_BYTES
    cache.insert([5, 5, 5, 5], kv_of([5, 5, 5, 5], start=2), start=2)  # its first two are not held: nothing to attach to
    assert cache.match([5, 5, 5, 5]).tokens == 0 and cache.bytes == 6 * TOKEN_BYTES


def test_random_prompts_match_as_a_plain_search_over_every_prompt_kept_says():
    """Against brute force: with room for all, the match is the longest common prefix with any
    prompt inserted, and its KV is that prefix's."""
    rng = random.Random(7)
    cache = PrefixCache(budget_bytes=1 << 30)
    inserted: list[list[int]] = []
    for _ in range(300):
        base = rng.choice(inserted) if inserted and rng.random() < 0.7 else []
        ids = base[: rng.randint(0, len(base))] + [rng.randint(0, 3) for _ in range(rng.randint(1, 6))]
        hit = cache.match(ids)
        expected = max((common(ids, other) for other in inserted), default=0)
        assert hit.tokens == expected
        if expected:
            assert_kv_equal(hit.kv, kv_of(ids[:expected]))
        cache.insert(ids, kv_of(ids, start=hit.tokens), start=hit.tokens)
        inserted.append(ids)


def common(a: Sequence[int], b: Sequence[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def test_the_least_recently_used_leaves_go_first_and_the_budget_always_holds():
    cache = PrefixCache(budget_bytes=10 * TOKEN_BYTES)
    cache.insert([1, 1, 1, 1], kv_of([1, 1, 1, 1]))
    cache.insert([2, 2, 2, 2], kv_of([2, 2, 2, 2]))
    cache.match([1, 1, 1, 1])  # 1s used after 2s
    cache.insert([3, 3, 3, 3], kv_of([3, 3, 3, 3]))  # 12 tokens: the 2s, least recently used, go
    assert [cache.match(ids).tokens for ids in ([1, 1, 1, 1], [2, 2, 2, 2], [3, 3, 3, 3])] == [4, 0, 4]
    assert cache.bytes == 8 * TOKEN_BYTES and cache.evicted_bytes == 4 * TOKEN_BYTES
    rng = random.Random(3)
    for _ in range(200):
        ids = [rng.randint(0, 2) for _ in range(rng.randint(1, 9))]
        hit = cache.match(ids)
        cache.insert(ids, kv_of(ids, start=hit.tokens), start=hit.tokens)
        assert cache.bytes <= cache.budget_bytes
        if cache.match(ids).tokens:  # what is kept is still right
            assert_kv_equal(cache.match(ids).kv, kv_of(ids[: cache.match(ids).tokens]))


def test_a_parent_left_without_children_is_evicted_in_its_turn():
    cache = PrefixCache(budget_bytes=6 * TOKEN_BYTES)
    cache.insert([1, 2, 3, 4], kv_of([1, 2, 3, 4]))
    cache.insert([1, 2, 5, 6], kv_of([1, 2, 5, 6]))  # [1, 2] | [3, 4] | [5, 6]: 6 tokens
    cache.insert([9, 9, 9, 9, 9], kv_of([9, 9, 9, 9, 9]))  # 11: both branches, then [1, 2] itself go
    assert cache.match([1, 2, 3, 4]).tokens == 0 and cache.match([9, 9, 9, 9, 9]).tokens == 5
    assert cache.bytes == 5 * TOKEN_BYTES


# -- the engine ---------------------------------------------------------------------------------

GREEDY = SamplingParams(max_tokens=12)
SHARED = "the nile is the longest river in africa and flows north into the mediterranean sea"
PROMPTS = [
    SHARED,
    SHARED + " past cairo and alexandria",  # its beginning held: prefilled after it
    "who wrote hamlet",
    " ".join(["river"] * 40),  # past the 8-token sliding window, hit beyond it too
    " ".join(["river"] * 40) + " delta",
    "paris",
]


async def test_greedy_output_is_identical_with_the_cache_on_and_off_and_the_reuse_is_reported():
    off, on = tiny_engine(), tiny_engine(prefix_cache_mb=16)
    try:
        assert off.prefix_cache is None and on.prefix_cache is not None
        first = [(await on.generate([p], GREEDY))[0] for p in PROMPTS]
        again = [(await on.generate([p], GREEDY))[0] for p in PROMPTS]
        plain = [(await off.generate([p], GREEDY))[0] for p in PROMPTS]
        for cached in (first, again):
            assert [g.token_ids for g in cached] == [g.token_ids for g in plain]
            assert [g.text for g in cached] == [g.text for g in plain]
        assert all(g.cached_tokens == 0 for g in plain)
        assert first[1].cached_tokens == first[0].prompt_tokens  # all of SHARED's prompt
        assert first[4].cached_tokens == first[3].prompt_tokens
        assert [g.cached_tokens for g in again] == [g.prompt_tokens - 1 for g in again]  # all but the last token
        assert all(g.prompt_tokens == p.prompt_tokens for g, p in zip(again, plain, strict=True))
    finally:
        await off.close()
        await on.close()


async def test_a_prompt_prefilled_ahead_is_generated_from_its_cached_kv_with_the_same_output():
    """`prefill` (speculative prefill's call): nothing generated, the prompt's KV cached, so that
    the prompt, or one that begins the same way, is prefilled only past it; greedy output as
    without. Without a prefix cache it computes nothing."""
    off, on = tiny_engine(), tiny_engine(prefix_cache_mb=16)
    try:
        (prefilled,) = await on.prefill([PROMPTS[3]])
        assert (prefilled.text, prefilled.completion_tokens, prefilled.finish_reason) == ("", 0, "length")
        assert prefilled.cached_tokens == 0 and on.prefix_cache is not None and on.prefix_cache.bytes > 0
        assert (await on.prefill([PROMPTS[3]]))[0].cached_tokens == prefilled.prompt_tokens  # all of it, held
        same, longer = (await on.generate([PROMPTS[3]], GREEDY))[0], (await on.generate([PROMPTS[4]], GREEDY))[0]
        assert same.cached_tokens == same.prompt_tokens - 1 and longer.cached_tokens == prefilled.prompt_tokens
        plain = [(await off.generate([p], GREEDY))[0] for p in PROMPTS[3:5]]
        assert [same.token_ids, longer.token_ids] == [g.token_ids for g in plain]
        (nothing,) = await off.prefill([PROMPTS[0]])
        assert nothing.cached_tokens == 0 and nothing.completion_tokens == 0 and off.prefix_cache is None
    finally:
        await off.close()
        await on.close()


async def test_batched_concurrent_and_joining_rows_are_identical_with_the_cache_on():
    off, on = tiny_engine(), tiny_engine(prefix_cache_mb=16)
    try:
        plain = await off.generate(PROMPTS, GREEDY)
        batch = await on.generate(PROMPTS, GREEDY)  # one call: later rows hit earlier rows' prompts
        assert [g.token_ids for g in batch] == [g.token_ids for g in plain]
        assert batch[1].cached_tokens > 0
        params = [SamplingParams(max_tokens=n, logprobs=True) for n in (30, 5, 12, 8, 10, 3)]
        alone = [(await off.generate([p], sp))[0] for p, sp in zip(PROMPTS, params, strict=True)]
        running = on.stream([PROMPTS[3]], SamplingParams(max_tokens=60))
        await running.__anext__()
        together = await asyncio.gather(*(on.generate([p], sp) for p, sp in zip(PROMPTS, params, strict=True)))
        rest = [item async for item in running if isinstance(item, Generation)]
        assert rest and rest[0].token_ids[:12] == plain[3].token_ids
        for (got,), expected in zip(together, alone, strict=True):
            assert got.token_ids == expected.token_ids
            torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(expected.logprobs), atol=1e-4, rtol=0)
    finally:
        await off.close()
        await on.close()


async def test_a_cache_too_small_for_a_prompt_changes_nothing_and_stays_in_its_budget():
    off, on = tiny_engine(), tiny_engine(prefix_cache_mb=0.0005)  # 524 bytes: a few tokens
    try:
        for prompt in PROMPTS * 2:
            (expected,), (got,) = await off.generate([prompt], GREEDY), await on.generate([prompt], GREEDY)
            assert got.token_ids == expected.token_ids
            assert on.prefix_cache is not None and on.prefix_cache.bytes <= on.prefix_cache.budget_bytes
    finally:
        await off.close()
        await on.close()


# -- the embedded model, every pipeline --------------------------------------------------------


class WikipediaRetriever(RecordingRetriever):
    """Real Wikipedia summaries as documents: a few articles, so that requests share some."""

    def __init__(self) -> None:
        super().__init__()
        from telerag.retrieval.corpus import read_wikipedia

        titles = ("Nile", "Mona Lisa", "Louis Armstrong", "Amazon River", "Paris")
        self.articles = {a.title: a.text[:600] for a in read_wikipedia() if a.title in titles}

    async def search(self, queries, options, ticket=None):
        outcome = await super().search(queries, options, ticket)
        ranked = [sorted(self.articles, key=lambda title, q=q: zlib.crc32(f"{q}|{title}".encode())) for q in queries]
        outcome.documents[:] = [
            [
                RetrievedPassage(id=j, doc_id=t, title=t, text=self.articles[t], score=1 - j / 10)
                for j, t in enumerate(r[: options.top_k])
            ]
            for r in ranked
        ]
        return outcome


class Recording:
    """An engine that keeps every Generation it returns."""

    def __init__(self, engine: TransformersEngine) -> None:
        self.engine, self.generations = engine, []

    def __getattr__(self, name: str):
        return getattr(self.engine, name)

    async def generate(self, prompts, params, on_chunk=None):
        generations = await self.engine.generate(prompts, params, on_chunk)
        self.generations += generations
        return generations


@pytest.mark.slow
@pytest.mark.minutes(3)  # 2.5 minutes here: every pipeline twice on the 270M model
async def test_every_pipelines_real_prompts_get_identical_answers_from_the_embedded_gemma_with_the_cache(monkeypatch):
    async def run_all(engine: TransformersEngine) -> tuple[list[Generation], dict[str, str]]:
        recording = Recording(engine)
        pipelines = build_pipelines(recording, WikipediaRetriever())  # type: ignore[arg-type]
        answers = {}
        for name, pipeline in pipelines.items():
            result = await pipeline.run("How long is the Nile?", RunOptions(max_tokens=16), ignore_events)
            answers[name] = result.answer
        return recording.generations, answers

    off, on = TransformersEngine.embedded_default(), TransformersEngine.embedded_default(prefix_cache_mb=256)
    try:
        (plain, plain_answers), (cached, cached_answers) = await run_all(off), await run_all(on)
    finally:
        await off.close()
        await on.close()
    assert len(cached_answers) == 7 and cached_answers == plain_answers
    assert [g.token_ids for g in cached] == [g.token_ids for g in plain]
    assert sum(g.cached_tokens for g in cached) > 0.3 * sum(g.prompt_tokens for g in cached)


# -- reported -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def app_on_the_tiny_engine():
    engine = tiny_engine(prefix_cache_mb=16)
    runtime = Runtime(
        settings=settings(), engine=engine, retriever=RecordingRetriever(), datastore_info=DATASTORE_INFO, cache_stats=CacheStats
    )
    app = create_app(runtime.settings)
    start_serving(app, runtime)
    yield app, engine
    asyncio.run(engine.close())


async def test_the_reuse_is_reported_per_step_in_openai_usage_and_in_metrics(app_on_the_tiny_engine):
    import httpx

    app, engine = app_on_the_tiny_engine
    question = {"query": "How long is the Nile?", "pipeline": "naive", "max_tokens": 4}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test", timeout=60) as http:
        first = (await http.post("/v1/rag/query", json=question)).json()
        second = (await http.post("/v1/rag/query", json=question)).json()
        (step,) = [s for s in second["steps"] if s["kind"] == "llm"]
        assert step["tokens_cached"] == step["tokens_in"] - 1  # the same prompt: all but its last token
        assert [s["tokens_cached"] for s in first["steps"] if s["kind"] == "llm"] != [step["tokens_cached"]]

        client = sdk(http)
        chat = {"model": "naive", "messages": [{"role": "user", "content": "How long is the Nile?"}], "max_tokens": 4}
        await client.chat.completions.create(**chat)
        completion = await client.chat.completions.create(**chat)
        assert completion.usage is not None and completion.usage.prompt_tokens_details is not None
        assert completion.usage.prompt_tokens_details.cached_tokens == completion.usage.prompt_tokens - 1
        response = await client.responses.create(model="naive", input="How long is the Nile?", max_output_tokens=4)
        assert response.usage is not None
        assert response.usage.input_tokens_details.cached_tokens == response.usage.input_tokens - 1

        llm = ChatOpenAI(model="naive", base_url="http://test/v1", api_key="unused", http_async_client=http, max_tokens=4)
        message = await llm.ainvoke("How long is the Nile?")
        assert message.usage_metadata is not None
        assert message.usage_metadata["input_token_details"]["cache_read"] == message.usage_metadata["input_tokens"] - 1

        metrics = (await http.get("/metrics")).text
    samples = {
        line.split(" ")[0]: float(line.split(" ")[1])
        for line in metrics.splitlines()
        if line.startswith(("telerag_prompt_tokens_total", "telerag_prefix_cache"))
    }
    prompt = sum(v for k, v in samples.items() if k.startswith("telerag_prompt_tokens_total"))
    hits = sum(v for k, v in samples.items() if k.startswith("telerag_prefix_cache_hit_tokens_total"))
    assert 0 < hits < prompt
    assert samples["telerag_prefix_cache_bytes"] == engine.prefix_cache.bytes > 0


# -- prompts laid out for reuse -------------------------------------------------------------------


async def test_self_rags_critique_reuses_the_whole_prompt_of_the_draft_it_judges():
    engine = tiny_engine(prefix_cache_mb=16)
    try:
        pipeline = build_pipelines(engine, RecordingRetriever(), names=["self_rag"])["self_rag"]
        result = await pipeline.run("How long is the Nile?", RunOptions(max_tokens=8), ignore_events)
    finally:
        await engine.close()
    steps = {step.stage.name: step for step in result.steps}
    draft, critique = steps["first_answer"], steps["critique"]
    assert critique.tokens_cached >= draft.tokens_in - 2  # all of the draft's prompt (its template's end aside)
