"""Question sets for the benchmarks, and running a pipeline over one.

A question file has one question a line, optionally tagged with the article that answers it and
a reference answer: `question [Article title] => answer | another accepted answer`. `#` lines
are comments. The shipped set is `config/questions_wiki_en.txt`.

A follow-up comes after the turns of its conversation, user and assistant in turn, each ending
in ` || `, and may give its standalone form after ` ~ `:
`Tell me about Paris. || It is the capital of France. || What river runs through it? ~ What river
runs through Paris? [Seine] => the Seine`. The shipped set is `config/followups_wiki_en.txt`.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from telerag.pipelines.types import Pipeline, RagResult, RunOptions, Turn, ignore_events

_LINE = re.compile(r"^(?P<text>.*?)\s*(?:\[(?P<title>[^\]]+)\])?\s*(?:=>\s*(?P<answers>.*?))?\s*$")
ANSWER_SEPARATOR = "|"


TURN_SEPARATOR, STANDALONE_SEPARATOR = " || ", " ~ "


@dataclass(frozen=True)
class Question:
    text: str
    title: str | None = None  # the article that answers it, when the file says
    answers: tuple[str, ...] = ()  # accepted reference answers; empty when the file gives none
    history: tuple[Turn, ...] = ()  # a follow-up's conversation before it
    standalone: str | None = None  # a follow-up asked without its conversation, when the file says

    def as_asked(self) -> Question:
        """The follow-up without its conversation (what is searched without a rewrite)."""
        return replace(self, history=(), standalone=None)

    def as_standalone(self) -> Question:
        """The follow-up's standalone form, without its conversation (what a rewrite aims at)."""
        return replace(self, text=self.standalone or self.text, history=(), standalone=None)


def parse_question(line: str) -> Question:
    """One line of a question file (see the module docstring)."""
    *turns, last = line.strip().split(TURN_SEPARATOR)
    match = _LINE.match(last)
    assert match is not None  # every part of the pattern is optional
    text, _, standalone = match.group("text").partition(STANDALONE_SEPARATOR)
    answers = match.group("answers") or ""
    return Question(
        text=text.strip(),
        title=match.group("title").strip() if match.group("title") else None,
        answers=tuple(a.strip() for a in answers.split(ANSWER_SEPARATOR) if a.strip()),
        history=tuple(Turn("user" if at % 2 == 0 else "assistant", turn.strip()) for at, turn in enumerate(turns)),
        standalone=standalone.strip() or None,
    )


def question_options(question: Question, options: RunOptions) -> RunOptions:
    """The run's options for `question`: its conversation, if it is a follow-up."""
    return replace(options, history=question.history)


def read_questions(path: Path, limit: int | None = None) -> list[Question]:
    """The questions of a file, in order (the first `limit` only, if given)."""
    questions = [
        parse_question(line)
        for line in Path(path).read_text(encoding="utf-8").splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]
    return questions[:limit] if limit else questions


async def run_one(pipeline: Pipeline, question: str, options: RunOptions) -> RagResult:
    return await pipeline.run(question, options, ignore_events)


async def run_questions(
    pipeline: Pipeline, questions: Sequence[Question], options: RunOptions
) -> AsyncIterator[tuple[Question, RagResult]]:
    """Each question's result, one question at a time (so each one's timings are its own)."""
    for question in questions:
        yield question, await run_one(pipeline, question.text, question_options(question, options))
