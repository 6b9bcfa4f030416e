"""`telerag bench quality`: the answer and recall metrics, the exact-search replay, and the
command itself on tiny random models over a slice of the real corpus."""

from __future__ import annotations

import asyncio
import json

import pytest

from telerag.benchmarks.quality import (
    article_found,
    exact_match,
    normalize_answer,
    token_f1,
)
from telerag.benchmarks.random_llm import tiny_random_lm
from telerag.benchmarks.search_recorder import SearchRecorder
from telerag.cli import main as cli
from telerag.config.settings import packaged_config
from telerag.pipelines.datastores import open_retriever
from telerag.pipelines.embedder import Embedder
from telerag.pipelines.prompts import holds_answer_cue
from telerag.pipelines.questions import read_questions
from telerag.pipelines.types import RetrievedPassage, SearchOptions
from telerag.retrieval.builder import build_datastore
from telerag.retrieval.corpus import read_wikipedia, split_passages
from tests.retrieval_helpers import tiny_cross_encoder
from tests.tiny_models import tiny_embedder_dir

QUESTIONS = packaged_config("questions_wiki_en.txt")
FOLLOW_UPS = packaged_config("followups_wiki_en.txt")


# -- metrics -------------------------------------------------------------------------------------


def test_normalize_answer_is_squad_normalisation():
    assert normalize_answer("  The Name of the Rose! ") == "name of rose"
    assert normalize_answer("An apple, a pear") == "apple pear"
    assert normalize_answer("Theory") == "theory"  # "the" only as a word


def test_exact_match_takes_the_best_reference():
    assert exact_match("The Bell Jar.", ["The Bell Jar"]) == 1.0
    assert exact_match("Ariel", ["The Bell Jar"]) == 0.0
    assert exact_match("Kangxi", ["Kangxi Emperor", "Kangxi"]) == 1.0
    assert exact_match("anything", []) == 0.0


def test_token_f1_on_known_inputs():
    # prediction "jimmy page guitar", reference "jimmy page": precision 2/3, recall 1 -> F1 0.8
    assert token_f1("Jimmy Page, guitar", ["Jimmy Page"]) == pytest.approx(0.8)
    assert token_f1("Jimmy Page", ["Jimmy Page"]) == 1.0
    assert token_f1("Robert Plant", ["Jimmy Page"]) == 0.0
    # the best of several references; repeated tokens count once per occurrence
    assert token_f1("page page", ["page", "Jimmy Page"]) == pytest.approx(2 / 3)
    assert token_f1("the", ["a"]) == 1.0  # both normalise to nothing
    assert token_f1("", ["Jimmy Page"]) == 0.0


def _doc(i: int, title: str, score: float = 1.0) -> RetrievedPassage:
    return RetrievedPassage(id=i, doc_id=title, title=title, text="", score=score)


def test_an_answer_still_holding_the_cue_is_counted():
    assert holds_answer_cue("Paris\nAnswer: Paris") and holds_answer_cue("Answer:")
    assert not holds_answer_cue("Paris") and not holds_answer_cue("The answer is Paris")


def test_article_found_counts_only_the_first_k():
    docs = [_doc(1, "A"), _doc(2, "B"), _doc(3, "C")]
    assert article_found(docs, "B", 2) and not article_found(docs, "C", 2) and not article_found([], "A", 3)


# -- the exact-search replay, on a real retriever over a random-embedded slice of the corpus --------


@pytest.fixture(scope="module")
def wiki_slice(tmp_path_factory):
    """The articles of the first 8 questions and 40 others, embedded by a tiny random BERT, in
    8 lists; and a tiny random LM saved as a model directory."""
    root = tmp_path_factory.mktemp("quality")
    tagged = {q.title for q in read_questions(QUESTIONS, limit=8)}
    articles = list(read_wikipedia())
    chosen = [a for a in articles if a.title in tagged] + [a for a in articles if a.title not in tagged][:40]
    embedder_dir = tiny_embedder_dir(32, 0)
    embedder = Embedder(embedder_dir)
    build_datastore(split_passages(chosen), embedder.encode, embedder=embedder.name, out_dir=root / "ds", nlist=8, progress=False)
    model, tokenizer = tiny_random_lm(0)
    model.save_pretrained(root / "lm")
    tokenizer.save_pretrained(root / "lm")
    return {"datastore": root / "ds", "embedder": embedder_dir, "model": root / "lm"}


@pytest.mark.slow  # builds tiny models and a datastore: ~1 min on two busy cores
async def test_replay_is_the_exact_search_of_the_queries_the_answer_came_from(wiki_slice):
    retriever = open_retriever(wiki_slice["datastore"], Embedder(wiki_slice["embedder"]), device="cpu", nprobe=1)
    try:
        recorder = SearchRecorder(retriever)
        probed = SearchOptions(top_k=3, nprobe=1)
        await recorder.search(["Who wrote The Little Prince?"], probed)
        second = await recorder.search(["Which planet is the largest?", "What is iron?"], probed)
        exact = await recorder.exact_documents(second.documents[1][:2], nlist=8, k=3)
        expected = await retriever.search(["Which planet is the largest?", "What is iron?"], SearchOptions(top_k=3, nprobe=8))
        best: dict[int, float] = {}
        for d in (d for group in expected.documents for d in group):
            best[d.id] = max(d.score, best.get(d.id, d.score))
        by_score = sorted(best, key=lambda i: (-best[i], i))[:3]
        assert [d.id for d in exact] == by_score  # only the second search replayed, merged
        assert recorder.searches == []  # forgotten: the next question starts afresh
    finally:
        retriever.close()


async def test_questions_answered_together_keep_their_searches_apart():
    class Echo:
        async def search(self, queries, options, ticket=None):
            await asyncio.sleep(0)
            return queries

    recorder = SearchRecorder(Echo())

    async def question(name: str) -> list[list[str]]:
        with recorder.question():
            await recorder.search([f"{name}1"], SearchOptions(top_k=3))
            await asyncio.gather(recorder.search([f"{name}2"], SearchOptions(top_k=3)))  # from a task of its own
            return [s.queries for s in recorder.searches]

    assert await asyncio.gather(question("a"), question("b")) == [[["a1"], ["a2"]], [["b1"], ["b2"]]]
    assert recorder.searches == []


# -- the command ---------------------------------------------------------------------------------


def _run(capsys, wiki_slice, *flags: str) -> list[dict]:
    code = cli.main(
        [
            "bench",
            "quality",
            "--limit",
            "8",
            "--k",
            "10",
            "--max-tokens",
            "4",
            "--json",
            "--device",
            "cpu",
            "--model",
            str(wiki_slice["model"]),
            "--embedder",
            str(wiki_slice["embedder"]),
            "--datastore",
            str(wiki_slice["datastore"]),
            *flags,
        ]
    )
    assert code == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert "recall@k" in "\n".join(out[:-1])  # the table comes before the JSON line
    return json.loads(out[-1])["rows"]


@pytest.mark.slow  # builds tiny models and a datastore: ~1 min on two busy cores
def test_bench_quality_reports_every_pipeline(capsys, wiki_slice):
    rows = _run(capsys, wiki_slice, "--pipelines", "all", "--nprobe", "8")
    assert [r["pipeline"] for r in rows] == ["naive", "hyde", "subquestion", "iterative", "iter_retgen", "flare", "self_rag"]
    for row in rows:
        assert row["questions"] == 8 and row["k"] == 10 and row["nprobe"] == 8 and row["nlist"] == 8
        for name in ("recall", "recall_exact", "exact_match", "f1"):
            assert 0.0 <= row[name] <= 1.0, (row["pipeline"], name)
        assert 0 <= row["cue_answers"] <= 8, row["pipeline"]
        assert set(row["latency_ms"]) == {"prefetch", "pre_retrieval", "search", "llm", "generate", "total"}
        assert row["latency_ms"]["total"] > 0.0
        assert row["latency_ms"]["generate"] + row["latency_ms"]["pre_retrieval"] > 0.0  # FLARE writes in sentences
        # every list probed: the replay is the very search the pipeline made
        assert row["recall_exact"] == row["recall"], row["pipeline"]
    assert rows[0]["latency_ms"]["pre_retrieval"] == 0.0 and rows[1]["latency_ms"]["pre_retrieval"] > 0.0


@pytest.mark.slow  # builds tiny models and a datastore: ~1 min on two busy cores
def test_follow_ups_are_measured_rewritten_as_asked_and_standalone(capsys, wiki_slice):
    rows = _run(capsys, wiki_slice, "--pipelines", "naive", "--nprobe", "8", "--questions", str(FOLLOW_UPS))
    assert [(r["pipeline"], r["form"]) for r in rows] == [("naive", "rewritten"), ("naive", "as asked"), ("naive", "standalone")]
    assert all(r["questions"] == 8 and 0.0 <= r["recall"] <= 1.0 for r in rows)
    rewritten, asked, _ = (r["latency_ms"] for r in rows)
    assert rewritten["pre_retrieval"] > 0.0 and asked["pre_retrieval"] == 0.0  # the rewrite is the pre-retrieval call


@pytest.mark.slow  # builds tiny models and a datastore: ~1 min on two busy cores
def test_questions_at_a_time_change_no_retrieval_number(capsys, wiki_slice):
    one = _run(capsys, wiki_slice, "--pipelines", "naive", "--nprobe", "1")[0]
    four = _run(capsys, wiki_slice, "--pipelines", "naive", "--nprobe", "1", "--concurrency", "4")[0]
    assert (four["recall"], four["recall_exact"]) == (one["recall"], one["recall_exact"])


@pytest.mark.slow  # builds tiny models and a datastore: ~1 min on two busy cores
def test_retrieval_only_is_naives_retrieval(capsys, wiki_slice):
    naive = _run(capsys, wiki_slice, "--pipelines", "naive", "--nprobe", "1")[0]
    alone, by_words, both = _run(
        capsys, wiki_slice, "--retrieval-only", "--nprobe", "1", "--search-modes", "dense,keyword,hybrid"
    )
    assert alone["pipeline"] == "retrieval dense" and alone["exact_match"] is None and alone["f1"] is None
    assert alone["cue_answers"] is None
    assert (alone["recall"], alone["recall_exact"]) == (naive["recall"], naive["recall_exact"])
    assert alone["recall_exact"] > 0.0  # 10 of ~55 passages: not every question misses
    assert (by_words["pipeline"], both["pipeline"]) == ("retrieval keyword", "retrieval hybrid")
    assert by_words["recall"] == by_words["recall_exact"] > 0.0  # the words' search probes no list
    assert alone["latency_ms"]["generate"] == 0.0 and alone["latency_ms"]["search"] > 0.0


@pytest.mark.slow  # builds tiny models and a datastore: ~1 min on two busy cores
def test_retrieval_only_adds_reranked_rows_where_a_reranker_is_configured(capsys, wiki_slice, tmp_path):
    (tmp_path / "ce").mkdir()
    model = tiny_cross_encoder(tmp_path / "ce", {"who", "what", "wrote", "prince", "planet", "largest"})
    config = tmp_path / "c.yaml"
    config.write_text(f"retrieval:\n  reranker: {model}\n")
    rows = _run(
        capsys, wiki_slice, "--retrieval-only", "--nprobe", "1", "--search-modes", "dense,hybrid", "--config", str(config)
    )
    assert [r["pipeline"] for r in rows] == [
        *("retrieval dense", "retrieval hybrid", "retrieval dense reranked", "retrieval hybrid reranked")
    ]
    assert all(0.0 <= r["recall"] <= 1.0 and r["search_p50_ms"] > 0 for r in rows)


@pytest.mark.slow  # builds tiny models and a datastore: ~1 min on two busy cores
def test_bench_quality_runs_the_requests_pipelined_when_asked(capsys, wiki_slice):
    on = _run(capsys, wiki_slice, "--pipelines", "iter_retgen", "--nprobe", "8", "--pipelining", "on")[0]
    off = _run(capsys, wiki_slice, "--pipelines", "iter_retgen", "--nprobe", "8")[0]
    assert on["pipelining"] and on["pipelined"]["retrievals"] > 0  # rounds 2 and 3 launched from the answer so far
    assert not off["pipelining"] and off["pipelined"] == {"retrievals": 0, "searched_again": 0, "checked": 0, "differed": 0}
    assert on["recall_exact"] == on["recall"]  # every list probed: the replay is the stale search itself
