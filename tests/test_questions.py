"""Question files: the line format, and the shipped set against the built-in corpus."""

from __future__ import annotations

from telerag.benchmarks.quality import normalize_answer
from telerag.pipelines.questions import Question, parse_question, read_questions
from telerag.retrieval.corpus import read_wikipedia
from telerag.server.settings import packaged_config

QUESTIONS = packaged_config("questions_wiki_en.txt")


def test_parse_question_lines():
    assert parse_question("Who wrote Hamlet? [William Shakespeare] => Shakespeare | William Shakespeare") == Question(
        "Who wrote Hamlet?", "William Shakespeare", ("Shakespeare", "William Shakespeare")
    )
    # the older forms still read: no answer, no title
    assert parse_question("Who wrote Hamlet? [William Shakespeare]") == Question("Who wrote Hamlet?", "William Shakespeare")
    assert parse_question("What is iron?") == Question("What is iron?")
    assert parse_question("What is iron? => a metal") == Question("What is iron?", None, ("a metal",))
    # brackets inside the question are the question's; only a trailing tag is the title
    assert parse_question("What does [sic] mean? [Sic]=>thus") == Question("What does [sic] mean?", "Sic", ("thus",))


def test_read_questions_skips_comments_and_blank_lines(tmp_path):
    path = tmp_path / "q.txt"
    path.write_text("# comment\nWho wrote Hamlet? [William Shakespeare] => Shakespeare\n\nWhat is iron?\n")
    assert [q.text for q in read_questions(path)] == ["Who wrote Hamlet?", "What is iron?"]
    assert read_questions(path, limit=1) == [Question("Who wrote Hamlet?", "William Shakespeare", ("Shakespeare",))]


def test_shipped_questions_are_answered_by_their_articles():
    """Every question is tagged with an article of the built-in corpus and has a reference answer
    whose every word is in that article's summary (title included)."""
    questions = read_questions(QUESTIONS)
    assert len(questions) >= 200
    assert len({q.text for q in questions}) == len(questions)
    articles = {a.title: a for a in read_wikipedia()}
    missing = [q.title for q in questions if q.title not in articles]
    assert not missing, f"titles not in the corpus: {missing}"
    unstated = []
    for q in questions:
        assert q.text.endswith("?") and q.answers, q
        article = articles[q.title]
        summary = normalize_answer(f"{article.title} {article.text}")
        unstated += [(q.title, a) for a in q.answers if not all(w in summary for w in normalize_answer(a).split())]
    assert not unstated, f"answers not stated in their article: {unstated}"
