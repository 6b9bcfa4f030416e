"""`telerag bench prefix-cache`'s study on the tiny random Gemma 3: the question stream's repeats,
and rows whose counts say what each mode reused (exact reuse gives the same answers)."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest

from telerag.benchmarks.prefix_cache import CACHE_MODES, format_table, prefix_cache_study, question_stream
from telerag.pipelines.questions import Question
from telerag.pipelines.registry import build_pipelines
from telerag.pipelines.types import RunOptions
from tests.fakes import RecordingRetriever
from tests.tiny_models import tiny_engine

QUESTIONS = [Question(f"question number {i} about rivers") for i in range(6)]


def test_every_question_comes_once_and_the_repeated_ones_again_two_questions_later():
    stream = question_stream(QUESTIONS, repeat=1.0)
    assert len(stream) == 12 and set(stream) == set(QUESTIONS)
    for q in QUESTIONS:
        first, second = (i for i, s in enumerate(stream) if s == q)
        assert second > first
    assert question_stream(QUESTIONS, repeat=0.0) == QUESTIONS
    some = question_stream(QUESTIONS, repeat=0.5, seed=3)
    assert some == question_stream(QUESTIONS, repeat=0.5, seed=3) and 6 < len(some) < 12


async def test_the_study_reports_each_mode_and_exact_reuse_answers_as_without_it():
    engine = tiny_engine()
    pipelines = build_pipelines(engine, RecordingRetriever(), names=["naive", "iter_retgen"])
    stream = question_stream(QUESTIONS[:3], repeat=1.0)
    try:
        rows = await prefix_cache_study(engine, list(pipelines.values()), stream, RunOptions(max_tokens=6), cache_mb=16)
    finally:
        await engine.close()
    assert [(r.pipeline, r.cache) for r in rows] == [(p, c) for p in ("naive", "iter_retgen") for c in CACHE_MODES]
    for pipeline in ("naive", "iter_retgen"):
        off, prefix, per_document = (r for r in rows if r.pipeline == pipeline)
        assert off.requests == prefix.requests == per_document.requests == len(stream)
        assert off.cached_tokens == 0 and off.cache_bytes == 0 and off.identical_outputs == 1.0
        assert prefix.identical_outputs == 1.0  # exact reuse
        assert prefix.prompt_tokens == off.prompt_tokens and 0 < prefix.cached_tokens < prefix.prompt_tokens
        assert prefix.cache_bytes > 0
        assert per_document.cached_tokens > 0 and 0 <= per_document.identical_outputs <= 1
    assert engine.prefix_cache is None and engine.document_kv is None  # as configured, after the study
    line = json.loads(json.dumps({"rows": [asdict(r) for r in rows]}))
    assert set(line["rows"][0]) == {
        "pipeline", "cache", "requests", "ttft_ms_p50", "latency_ms_p50", "prompt_tokens", "cached_tokens",
        "identical_outputs", "cache_bytes",
    }  # fmt: skip
    assert len(format_table(rows).splitlines()) == len(rows) + 1


async def test_the_modes_begin_with_the_run_without_reuse():
    engine = tiny_engine()
    try:
        with pytest.raises(ValueError, match="begin with off"):
            await prefix_cache_study(engine, [], QUESTIONS, RunOptions(), 16, modes=("prefix", "off"))
    finally:
        await engine.close()


def test_the_commands_flags_reach_the_study_and_the_runtime_flags_keep_theirs():
    from telerag.cli.main import build_parser

    args = build_parser().parse_args(["bench", "prefix-cache", "--kv-cache-mb", "64", "--modes", "off", "prefix"])
    assert args.kv_cache_mb == 64 and args.modes == ["off", "prefix"]
    assert args.cache_mb is None  # retrieval.cache_mb, a runtime flag: unset
    assert build_parser().parse_args(["bench", "prefix-cache"]).kv_cache_mb == 256
