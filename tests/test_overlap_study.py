"""The overlap study: per-pipeline means from the traced runs."""

from __future__ import annotations

from telerag.benchmarks.overlap import overlap_study
from telerag.pipelines.questions import Question, read_questions
from telerag.pipelines.registry import build_pipelines
from telerag.pipelines.types import RunOptions
from telerag.server.settings import packaged_config
from tests.fakes import RecordingRetriever, Reply, ScriptedEngine


async def test_study_reports_means_per_pipeline():
    engine = ScriptedEngine(lambda prompt: Reply("an answer"))
    pipelines = build_pipelines(engine, RecordingRetriever(), names=["naive", "hyde"])
    questions = read_questions(packaged_config("questions_wiki_en.txt"), limit=2)
    rows = await overlap_study(list(pipelines.values()), questions, RunOptions(max_tokens=8))
    assert [r.pipeline for r in rows] == ["naive", "hyde"]
    assert all(r.questions == 2 and r.overlap_rate == 0.75 for r in rows)  # the fake reports 0.75 per search
    assert rows[0].pre_retrieval_ms == 0.0 and rows[1].pre_retrieval_ms > 0.0
    assert rows[0].article_hit_rate == 0.0  # the fake's documents are never the real article


async def test_study_counts_answers_that_are_empty_or_loop_on_the_cue():
    """The model of issue 17 that only repeats the cue gives empty answers, never a looping one."""
    engine = ScriptedEngine(lambda prompt: Reply("Answer: Answer: Answer:" if "Nile" in prompt else "Answer: Paris"))
    pipelines = build_pipelines(engine, RecordingRetriever(), names=["naive"])
    questions = [Question("How long is the Nile?", None), Question("Capital of France?", None)]
    (row,) = await overlap_study(list(pipelines.values()), questions, RunOptions(max_tokens=8))
    assert (row.empty_answers, row.cue_answers) == (1, 0)
