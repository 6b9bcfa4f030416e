"""The overlap study: per-pipeline means from the traced runs; `telerag bench overlap` on the
tiny LLM and a small datastore."""

from __future__ import annotations

import json

from telerag.benchmarks.overlap import OverlapReport, OverlapRow, format_table, overlap_study
from telerag.cli.main import main
from telerag.config.settings import packaged_config
from telerag.pipelines.questions import Question, read_questions
from telerag.pipelines.registry import build_pipelines
from telerag.pipelines.types import RunOptions
from tests.fakes import RecordingRetriever, Reply, ScriptedEngine
from tests.serving import build_small_datastore, save_tiny_lm
from tests.tiny_models import tiny_embedder_dir


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
    """A model that only repeats the cue gives empty answers, never a looping one."""
    engine = ScriptedEngine(lambda prompt: Reply("Answer: Answer: Answer:" if "Nile" in prompt else "Answer: Paris"))
    pipelines = build_pipelines(engine, RecordingRetriever(), names=["naive"])
    questions = [Question("How long is the Nile?", None), Question("Capital of France?", None)]
    (row,) = await overlap_study(list(pipelines.values()), questions, RunOptions(max_tokens=8))
    assert (row.empty_answers, row.cue_answers) == (1, 0)


def test_table_shows_what_was_not_measured_as_a_dash():
    row = OverlapRow(
        "naive", 2, overlap_rate=None, pre_retrieval_ms=0.0, total_ms=12.34, article_hit_rate=None, empty_answers=1, cue_answers=0
    )
    table = format_table(OverlapReport(questions=2, nlist=8, prefetch_clusters=3, nprobe=4, rows=[row]))
    assert table.splitlines() == [
        "2 questions, nlist 8, nprobe 4, prefetch depth 3 clusters",
        "pipeline       overlap  pre-retrieval ms  total ms  article hit  empty answers  cue answers",
        "naive                -               0.0      12.3            -              1            0",
    ]


def test_bench_overlap_prints_the_table_and_one_json_line(tmp_path, capsys):
    code = main(
        [
            "bench",
            "overlap",
            "--model",
            str(save_tiny_lm(tmp_path / "lm")),
            "--embedder",
            str(tiny_embedder_dir(32, 0)),
            "--datastore",
            str(build_small_datastore(tmp_path / "datastore", articles=200)),
            "--device",
            "cpu",
            "--pipelines",
            "naive,hyde",
            "--limit",
            "2",
            "--max-tokens",
            "4",
            "--nprobe",
            "2",
            "--prefetch-clusters",
            "3",
            "--json",
        ]
    )
    assert code == 0
    lines = capsys.readouterr().out.strip().splitlines()
    report = json.loads(lines[-1])
    assert list(report) == ["questions", "nlist", "prefetch_clusters", "nprobe", "rows"]
    assert (report["questions"], report["prefetch_clusters"], report["nprobe"]) == (2, 3, 2)
    assert lines[0] == f"2 questions, nlist {report['nlist']}, nprobe 2, prefetch depth 3 clusters"
    assert [row["pipeline"] for row in report["rows"]] == ["naive", "hyde"]
    assert all(row["questions"] == 2 and row["overlap_rate"] is not None for row in report["rows"])
