"""Question sets for the benchmarks, and running a pipeline over one.

A question file has one question a line, optionally tagged with the article that answers it and
a reference answer: `question [Article title] => answer | another accepted answer`. `#` lines
are comments. The shipped set is `config/questions_wiki_en.txt`.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from telerag.pipelines.types import Pipeline, RagResult, RunOptions, run_result

_LINE = re.compile(r"^(?P<text>.*?)\s*(?:\[(?P<title>[^\]]+)\])?\s*(?:=>\s*(?P<answers>.*?))?\s*$")
ANSWER_SEPARATOR = "|"


@dataclass(frozen=True)
class Question:
    text: str
    title: str | None = None  # the article that answers it, when the file says
    answers: tuple[str, ...] = ()  # accepted reference answers; empty when the file gives none


def parse_question(line: str) -> Question:
    """One line of a question file (see the module docstring)."""
    match = _LINE.match(line.strip())
    assert match is not None  # every part of the pattern is optional
    answers = match.group("answers") or ""
    return Question(
        text=match.group("text"),
        title=match.group("title").strip() if match.group("title") else None,
        answers=tuple(a.strip() for a in answers.split(ANSWER_SEPARATOR) if a.strip()),
    )


def read_questions(path: Path, limit: int | None = None) -> list[Question]:
    """The questions of a file, in order (the first `limit` only, if given)."""
    questions = [
        parse_question(line)
        for line in Path(path).read_text(encoding="utf-8").splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]
    return questions[:limit] if limit else questions


async def run_one(pipeline: Pipeline, question: str, options: RunOptions) -> RagResult:
    return await run_result(pipeline.run(question, options))


async def run_questions(
    pipeline: Pipeline, questions: Sequence[Question], options: RunOptions
) -> AsyncIterator[tuple[Question, RagResult]]:
    """Each question's result, one question at a time (so each one's timings are its own)."""
    for question in questions:
        yield question, await run_one(pipeline, question.text, options)
