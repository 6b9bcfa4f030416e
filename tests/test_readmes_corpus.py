"""The second corpus of `bench quality`: the installed packages' READMEs, written as a corpus a
datastore is built from, and questions that name each README's own identifiers, never its package."""

from __future__ import annotations

import json
import re
from pathlib import Path

from telerag.benchmarks.readmes import README_PACKAGES, installed_readmes
from telerag.cli.main import main
from telerag.pipelines.questions import read_questions
from telerag.retrieval.corpus import read_jsonl

QUESTIONS = Path(__file__).resolve().parents[1] / "config" / "questions_readmes.txt"
TOKEN = re.compile(r"\w+(?:[._]\w+)*")


def identifiers(text: str) -> list[str]:
    """What reads as code: dotted or snake_case names, and mixed case past the first letter (CamelCase)."""
    return [
        t
        for t in TOKEN.findall(text)
        if "_" in t or "." in t or (any(c.isupper() for c in t[1:]) and any(c.islower() for c in t))
    ]


def test_bench_readmes_writes_a_corpus_of_the_installed_readmes(tmp_path, capsys):
    assert main(["bench", "readmes", "--out", str(tmp_path / "c.jsonl"), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    articles = list(read_jsonl(tmp_path / "c.jsonl"))
    assert [a.title for a in articles] == list(summary["packages"]) and len(articles) >= 10
    assert set(summary["packages"]) | set(summary["missing"]) == set(README_PACKAGES)
    assert summary["words"] == sum(len(a.text.split()) for a in articles)


def test_each_question_names_identifiers_of_its_packages_readme_and_not_the_package():
    readmes = {readme.package: readme.text for readme in installed_readmes()[0]}
    questions = read_questions(QUESTIONS)
    assert len(questions) >= 30
    for question in questions:
        assert question.title in README_PACKAGES, question.text
        assert not re.search(rf"\b{re.escape(question.title)}\b", question.text, re.IGNORECASE), question.text
        named = identifiers(question.text)
        assert named, f"{question.text}: names no identifier"
        if question.title in readmes:  # installed here: its README holds what the question names
            assert all(name in readmes[question.title] for name in named), (question.title, named)
