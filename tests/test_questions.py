"""Question files: the line format, and the shipped set against the built-in corpus."""

from __future__ import annotations

from telerag.benchmarks.quality import normalize_answer
from telerag.config.settings import packaged_config
from telerag.pipelines.questions import Question, parse_question, read_questions
from telerag.pipelines.types import Turn
from telerag.retrieval.corpus import read_wikipedia

QUESTIONS = packaged_config("questions_wiki_en.txt")
FOLLOW_UPS = packaged_config("followups_wiki_en.txt")


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


def test_a_follow_up_line_has_its_conversation_and_its_standalone_form():
    line = (
        "Tell me about Paris. || It is the capital of France. || "
        "What river runs through it? ~ What river runs through Paris? [Seine] => the Seine"
    )
    question = parse_question(line)
    assert question == Question(
        "What river runs through it?",
        "Seine",
        ("the Seine",),
        history=(Turn("user", "Tell me about Paris."), Turn("assistant", "It is the capital of France.")),
        standalone="What river runs through Paris?",
    )
    assert question.as_asked() == Question("What river runs through it?", "Seine", ("the Seine",))
    assert question.as_standalone() == Question("What river runs through Paris?", "Seine", ("the Seine",))


def test_shipped_follow_ups_stand_alone_as_shipped_questions():
    """Each follow-up's standalone form is a shipped question, with its article and answers."""
    follow_ups = read_questions(FOLLOW_UPS)
    shipped = {q.text: q for q in read_questions(QUESTIONS)}
    assert len(follow_ups) >= 30 and all(len(q.history) >= 2 for q in follow_ups)
    assert [shipped.get(q.standalone or "") for q in follow_ups] == [q.as_standalone() for q in follow_ups]
    assert all(q.title not in q.text for q in follow_ups)  # they refer to the subject, never name it


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
