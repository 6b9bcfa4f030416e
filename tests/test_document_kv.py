"""Per-document KV (TurboRAG's option): prompts cut around their documents, keys moved to new
positions exactly as the model's own RoPE would have put them there, a one-document prompt
answered exactly as without the option, documents reused in any order and reported, and the
store within its budget. On the tiny random Gemma 3 (sliding and full layers, two RoPE bases)."""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicCache

from telerag.engines.transformers.document_kv import ChunkedIds, DocumentKV, rope_frequencies
from telerag.engines.transformers.prefix_cache import PrefixHit
from telerag.engines.types import SamplingParams
from telerag.pipelines import prompts
from telerag.pipelines.types import RetrievedPassage
from tests.tiny_models import tiny_engine

GREEDY = SamplingParams(max_tokens=10)
DOCS = [
    RetrievedPassage(id=3, doc_id="nile", title="Nile", text="the nile flows north through egypt.", score=0.9),
    RetrievedPassage(id=8, doc_id="amazon", title="Amazon", text="the amazon carries the most water.", score=0.8),
    RetrievedPassage(id=5, doc_id="danube", title="Danube", text="the danube crosses ten countries.", score=0.7),
]


def test_a_prompt_is_cut_around_its_documents_and_joins_back():
    for prompt in (
        prompts.answer("which river is longest?", DOCS, instructions="be brief"),
        prompts.critique("which river is longest?", DOCS, "the nile"),
        prompts.revise("which river is longest?", DOCS, "the nile"),
    ):
        text = f"<start>{prompt.system}\n\n{prompt.user}<end>"
        parts = prompts.document_chunks(text)
        assert parts is not None
        assert parts.head + "".join(parts.chunks) + parts.tail == text
        assert parts.head.endswith(prompts.DOCUMENTS_HEADING)
        assert len(parts.chunks) == 3
        for rank, (chunk, doc) in enumerate(zip(parts.chunks, sorted(DOCS, key=lambda d: d.id), strict=True)):
            assert chunk == f"[{rank + 1}] {doc.title}\n{doc.text}\n\n"
    assert prompts.document_chunks(prompts.answer("q", []).user) is None  # "(no documents)"
    assert prompts.document_chunks(prompts.hypothetical_passage("q").user) is None


def test_a_key_moved_by_the_rotation_equals_the_key_the_model_computes_there():
    engine = tiny_engine()
    frequencies = rope_frequencies(engine.model)
    assert frequencies is not None and len(frequencies) == engine.model.config.num_hidden_layers
    assert not torch.equal(frequencies[0], frequencies[1])  # a sliding and a full layer: two bases
    ids = torch.tensor([[5, 17, 230, 1001, 42, 7]])  # within the 8-token sliding window

    def kv_at(start: int) -> list:
        cache = DynamicCache(config=engine.model.config)
        with torch.inference_mode():
            positions = torch.arange(start, start + ids.shape[1])[None]
            engine.model(input_ids=ids, position_ids=positions, **{engine._cache_keyword: cache})
        return [(layer.keys, layer.values) for layer in cache.layers]

    store = DocumentKV(2**20, frequencies)
    for shift in (1, 37, 900):
        moved, there = store._rotated(kv_at(0), shift), kv_at(shift)
        for (keys, values), (expected_keys, expected_values) in zip(moved, there, strict=True):
            torch.testing.assert_close(keys, expected_keys, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(values, expected_values, atol=1e-4, rtol=1e-4)


def formatted(engine, documents, question="which river is longest?") -> str:
    prompt = prompts.answer(question, documents)
    return engine.format_prompt(prompt.user, system=prompt.system)


async def test_a_prompt_with_one_document_is_answered_exactly_as_without_the_option():
    off, on = tiny_engine(), tiny_engine(document_kv_mb=16)
    try:
        assert on.document_kv is not None and off.document_kv is None
        for doc in DOCS:
            prompt = formatted(on, [doc])
            (expected,), (got,) = await off.generate([prompt], GREEDY), await on.generate([prompt], GREEDY)
            assert got.token_ids == expected.token_ids
            assert got.prompt_tokens == expected.prompt_tokens
    finally:
        await off.close()
        await on.close()


async def test_documents_are_reused_wherever_they_land_and_the_reuse_is_reported():
    engine = tiny_engine(document_kv_mb=16)
    try:
        (first,) = await engine.generate([formatted(engine, DOCS[:2])], GREEDY)
        assert first.cached_tokens == 0  # nothing held yet
        (again,) = await engine.generate([formatted(engine, DOCS[:2], "another question")], GREEDY)
        assert 0 < again.cached_tokens < again.prompt_tokens  # the head and both documents, not the question
        (moved,) = await engine.generate([formatted(engine, [DOCS[0], DOCS[2]])], GREEDY)
        assert moved.cached_tokens > 0  # the head and the Nile, in first place again
        (same,) = await engine.generate([formatted(engine, DOCS[:2])], GREEDY)
        assert same.token_ids == first.token_ids  # deterministic: the same KV, the same answer
        assert engine.document_kv is not None and engine.document_kv.bytes <= engine.document_kv.budget_bytes
    finally:
        await engine.close()


async def test_a_store_too_small_for_a_document_still_answers_within_its_budget():
    roomy, tight = tiny_engine(document_kv_mb=16), tiny_engine(document_kv_mb=0.0005)
    try:
        for docs in (DOCS, DOCS[1:], DOCS):
            prompt = formatted(roomy, docs)
            (expected,), (got,) = await roomy.generate([prompt], GREEDY), await tight.generate([prompt], GREEDY)
            assert got.token_ids == expected.token_ids  # the same KV, computed again each time
            assert got.cached_tokens == 0
            assert tight.document_kv is not None and tight.document_kv.bytes <= tight.document_kv.budget_bytes
    finally:
        await roomy.close()
        await tight.close()


async def test_prompts_without_documents_and_batches_mixing_both_kinds_decode_as_without_the_option():
    off, on = tiny_engine(), tiny_engine(document_kv_mb=16, prefix_cache_mb=16)
    try:
        batch = ["who wrote hamlet", formatted(on, DOCS[:1]), "paris is the capital of france"]
        expected, got = await off.generate(batch, GREEDY), await on.generate(batch, GREEDY)
        assert [g.token_ids for g in got] == [g.token_ids for g in expected]
    finally:
        await off.close()
        await on.close()


def test_a_hit_is_assembled_head_first_then_each_document_at_its_place():
    engine = tiny_engine()
    frequencies = rope_frequencies(engine.model)
    assert frequencies is not None
    store = DocumentKV(2**20, frequencies)
    computed: list[tuple[int, tuple[int, ...]]] = []

    def kv_of(hit: PrefixHit, ids):
        computed.append((hit.tokens, tuple(ids)))
        keys = torch.arange(len(ids), dtype=torch.float32).reshape(1, 1, -1, 1).expand(1, 1, -1, 2 * len(frequencies[0])).clone()
        return [(keys, keys + 1) for _ in frequencies]

    hit, reused = store.assemble(ChunkedIds((1, 2), ((3, 4, 5), (6,))), kv_of)
    assert hit.tokens == 6 and reused == 0
    assert computed == [(0, (1, 2)), (2, (3, 4, 5)), (2, (6,))]  # each document after the head alone
    assert [k.shape[2] for k, _ in hit.kv] == [6] * len(frequencies)
    hit, reused = store.assemble(ChunkedIds((1, 2), ((6,), (3, 4, 5))), kv_of)
    assert reused == 6 and len(computed) == 3  # all held, in another order
