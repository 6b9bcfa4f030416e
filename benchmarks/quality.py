"""The quality benchmark: for each pipeline over a question set with tagged articles and reference
answers, how often the article is among the documents the answer drew on (at the configured
nprobe, and had those searches been exact), how good the answer is (SQuAD's exact match and
token F1), the cluster overlap rate and the mean time of each stage.

Exact search is a replay, not a second run: every search a pipeline makes is recorded, and once
the question is answered the searches its final documents came from are run again with every
list probed (nprobe = nlist), on the same queries, merged best score first as the pipelines
merge several queries' results. So the LLM runs once per question, its timings are its own, and
the two recalls differ only by what the IVF probe missed. For a pipeline that answers from one
search (naive, HyDE, SubQuestion, Iter-RetGen, FLARE, Self-RAG) the replay is exactly what the
pipeline would have had; for Iterative, which merges the searches of several rounds, only the
rounds its documents came from are replayed.

Neither recall bounds the other: probing more lists can bring in passages of other articles
that push the tagged one out of the top k. What holds is that with nprobe = nlist the two are
equal, and that exact search's i-th best score is never below the probed search's.
"""

from __future__ import annotations

import asyncio
import re
import statistics
import string
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from tqdm.auto import tqdm

from telerag.benchmarks.search_recorder import SearchRecorder
from telerag.config.settings import Settings
from telerag.pipelines.prompts import holds_answer_cue
from telerag.pipelines.questions import Question, question_options, run_one
from telerag.pipelines.stats import PipeliningSummary, Timings
from telerag.pipelines.types import (
    Pipeline,
    RagResult,
    RetrievedPassage,
    Retriever,
    RunOptions,
    SearchOptions,
    overlap_rates,
)
from telerag.retrieval.ranking import DENSE, Ranking, SearchMode
from telerag.server.process.runtime import load_reranker, open_retrieval, open_runtime

# -------------------------------------------------------------------------------------------------
# Answer metrics (SQuAD v1.1's evaluation script, rewritten)
# -------------------------------------------------------------------------------------------------

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)


def normalize_answer(text: str) -> str:
    """Lowercase, strip punctuation and the articles a/an/the, collapse whitespace."""
    return " ".join(_ARTICLES.sub(" ", text.lower().translate(_PUNCTUATION)).split())


def exact_match(prediction: str, references: Sequence[str]) -> float:
    """1.0 when the normalised prediction equals any normalised reference."""
    predicted = normalize_answer(prediction)
    return float(any(predicted == normalize_answer(r) for r in references))


def token_f1(prediction: str, references: Sequence[str]) -> float:
    """The best, over the references, F1 of the normalised tokens shared with the prediction."""
    predicted = normalize_answer(prediction).split()

    def f1(reference: str) -> float:
        expected = normalize_answer(reference).split()
        if not predicted or not expected:
            return float(predicted == expected)
        shared = sum((Counter(predicted) & Counter(expected)).values())
        if shared == 0:
            return 0.0
        precision, recall = shared / len(predicted), shared / len(expected)
        return 2 * precision * recall / (precision + recall)

    return max((f1(r) for r in references), default=0.0)


def article_found(documents: Sequence[RetrievedPassage], title: str, k: int) -> bool:
    """Whether a passage of the article `title` is among the first `k` documents."""
    return any(d.title == title for d in documents[:k])


# -------------------------------------------------------------------------------------------------
# The benchmark
# -------------------------------------------------------------------------------------------------

STAGES = ("prefetch", "pre_retrieval", "search", "llm", "generate", "total")


@dataclass
class StageLatency:
    """Mean milliseconds per question of each stage (a stage a pipeline lacks counts as 0)."""

    prefetch: float
    pre_retrieval: float
    search: float
    llm: float
    generate: float
    total: float


@dataclass
class QualityRow:
    pipeline: str
    questions: int
    k: int
    nprobe: int
    nlist: int
    recall: float | None  # share of tagged questions whose article is among the answer's top-k documents
    recall_exact: float | None  # the same had those searches been exact (nprobe = nlist)
    exact_match: float | None  # mean over questions with a reference answer; None without generation
    f1: float | None
    cue_answers: int | None  # answers still holding the answer cue (a reply looping on it); None without generation
    overlap_rate: float | None  # mean over searches with a prefetch of |C_in ∩ C_out| / |C_out|
    latency_ms: StageLatency
    form: str = "as written"  # follow-ups: "rewritten" (with their conversation), "as asked" or "standalone"
    pipelining: bool = False  # the requests' `pipelining`
    pipelined: PipeliningSummary = field(default_factory=PipeliningSummary)  # summed over the questions
    search_p50_ms: float | None = None  # retrieval alone: the median search (its embedding included)


def _mean(values: Sequence[float]) -> float | None:
    return statistics.fmean(values) if values else None


class _Tally:
    """Per-question numbers of one row, and the row they make."""

    def __init__(self) -> None:
        self.found: list[bool] = []
        self.found_exact: list[bool] = []
        self.em: list[float] = []
        self.f1: list[float] = []
        self.cue: list[bool] = []  # per answer generated: does it hold the answer cue
        self.overlaps: list[float] = []
        self.ms: dict[str, list[float]] = {stage: [] for stage in STAGES}
        self.pipelined: list[PipeliningSummary] = []

    def add_timings(self, timings: Timings) -> None:
        for stage in STAGES:
            self.ms[stage].append(getattr(timings, f"{stage}_ms"))

    def row(self, pipeline: str, questions: int, k: int, nprobe: int, nlist: int) -> QualityRow:
        return QualityRow(
            pipeline=pipeline,
            questions=questions,
            k=k,
            nprobe=nprobe,
            nlist=nlist,
            recall=_mean(self.found),
            recall_exact=_mean(self.found_exact),
            exact_match=_mean(self.em),
            f1=_mean(self.f1),
            cue_answers=sum(self.cue) if self.cue else None,
            overlap_rate=_mean(self.overlaps),
            latency_ms=StageLatency(**{stage: _mean(ms) or 0.0 for stage, ms in self.ms.items()}),
            pipelined=PipeliningSummary(
                **{name: sum(getattr(p, name) for p in self.pipelined) for name in PipeliningSummary.__dataclass_fields__}
            ),
        )


async def quality_study(
    pipelines: Sequence[Pipeline],
    recorder: SearchRecorder,
    questions: Sequence[Question],
    options: RunOptions,
    *,
    nprobe: int,
    nlist: int,
    concurrency: int = 1,
    on_question: Callable[[], None] = lambda: None,
) -> list[QualityRow]:
    """One row per pipeline; every pipeline must search through `recorder`. `nprobe` is what
    `options.nprobe` resolves to (reported); `on_question` is called after each question.
    `concurrency` questions run at a time (the engine batches them: more questions per second,
    but each one's stage times then include its neighbours')."""
    rows = []
    slots = asyncio.Semaphore(concurrency)

    async def answer(pipeline: Pipeline, question: Question) -> tuple[RagResult, list[RetrievedPassage]]:
        async with slots:
            with recorder.question():
                result = await run_one(pipeline, question.text, question_options(question, options))
                exact = await recorder.exact_documents(result.documents, nlist, options.top_k)
            on_question()
            return result, exact

    for pipeline in pipelines:
        tally = _Tally()
        answered = await asyncio.gather(*(answer(pipeline, q) for q in questions))
        for question, (result, exact) in zip(questions, answered, strict=True):
            if question.title is not None:
                tally.found.append(article_found(result.documents, question.title, options.top_k))
                tally.found_exact.append(article_found(exact, question.title, options.top_k))
            if question.answers:
                tally.em.append(exact_match(result.answer, question.answers))
                tally.f1.append(token_f1(result.answer, question.answers))
            tally.cue.append(holds_answer_cue(result.answer))
            tally.overlaps.extend(overlap_rates(result.steps))
            tally.add_timings(result.timings)
            tally.pipelined.append(result.pipelining)
        row = tally.row(pipeline.name, len(questions), options.top_k, nprobe, nlist)
        rows.append(replace(row, pipelining=options.pipelining))
    return rows


async def retrieval_study(
    retriever: Retriever,
    questions: Sequence[Question],
    *,
    k: int,
    nprobe: int,
    nlist: int,
    ranking: Ranking = DENSE,
    label: str | None = None,
    on_question: Callable[[], None] = lambda: None,
) -> QualityRow:
    """Naive's retrieval alone, no LLM: each question's own top-k at `nprobe` and exactly (every
    list probed: the dense half's), ranked by `ranking` (what the passage shape, the embedder
    and the search mode decide, in seconds rather than hours)."""
    tally = _Tally()
    searches_ms = []
    for question in questions:
        started = time.perf_counter()
        outcome = await retriever.search([question.text], SearchOptions(k, nprobe, False, ranking=ranking))
        ms = (time.perf_counter() - started) * 1e3
        searches_ms.append(ms)
        exact = await retriever.search([question.text], SearchOptions(k, nlist, False, ranking=ranking))
        if question.title is not None:
            tally.found.append(article_found(outcome.documents[0], question.title, k))
            tally.found_exact.append(article_found(exact.documents[0], question.title, k))
        tally.add_timings(Timings(search_ms=ms, total_ms=ms))
        on_question()
    row = tally.row(label or f"retrieval {ranking.mode}", len(questions), k, nprobe, nlist)
    return replace(row, search_p50_ms=statistics.median(searches_ms) if searches_ms else None)


FOLLOW_UP_FORMS: dict[str, Callable[[Question], Question]] = {
    "rewritten": lambda question: question,  # with its conversation: rewritten to stand alone first
    "as asked": Question.as_asked,  # searched as it is
    "standalone": Question.as_standalone,  # what the rewrite aims at
}


async def configured_quality_study(
    settings: Settings, names: Sequence[str], questions: Sequence[Question], k: int, max_tokens: int, concurrency: int = 1
) -> list[QualityRow]:
    """`quality_study` of the named pipelines with the configured LLM and datastore, at the
    configured nprobe and pipelining, with a progress bar. Follow-ups run in each of `FOLLOW_UP_FORMS`, so the
    rewrite's recall sits beside the question's without it and the question asked standalone."""
    async with open_runtime(settings) as runtime:
        info = runtime.datastore_info
        recorder = SearchRecorder(runtime.retriever)
        pipelines = runtime.pipelines(recorder, names)
        options = RunOptions(top_k=k, nprobe=info.nprobe, max_tokens=max_tokens, pipelining=settings.experiments.pipelining)
        forms = FOLLOW_UP_FORMS if any(q.history for q in questions) else {"as written": lambda q: q}
        rows: list[QualityRow] = []
        with tqdm(total=len(forms) * len(pipelines) * len(questions), desc="questions", unit="q") as bar:
            for form, shaped in forms.items():
                found = await quality_study(
                    list(pipelines.values()),
                    recorder,
                    [shaped(q) for q in questions],
                    options,
                    nprobe=info.nprobe,
                    nlist=info.nlist,
                    concurrency=concurrency,
                    on_question=bar.update,
                )
                rows.extend(replace(row, form=form) for row in found)
        return rows


async def configured_retrieval_study(
    settings: Settings, questions: Sequence[Question], k: int, modes: Sequence[str]
) -> list[QualityRow]:
    """`retrieval_study` of the configured datastore (no LLM loaded) in each search mode, and each
    again re-ranked where `retrieval.reranker` names a model, with a progress bar."""
    retriever = open_retrieval(settings)
    reranker = load_reranker(settings.retrieval)
    rankings = [(f"retrieval {mode}", settings.retrieval.ranking(SearchMode(mode))) for mode in modes]
    if reranker is not None:
        rankings += [
            (f"retrieval {mode} reranked", settings.retrieval.ranking(SearchMode(mode), reranker=reranker)) for mode in modes
        ]
    try:
        info = retriever.datastore_info()
        rows = []
        with tqdm(total=len(rankings) * len(questions), desc="questions", unit="q") as bar:
            for label, ranking in rankings:
                study = retrieval_study(
                    retriever,
                    questions,
                    k=k,
                    nprobe=info.nprobe,
                    nlist=info.nlist,
                    ranking=ranking,
                    label=label,
                    on_question=bar.update,
                )
                rows.append(await study)
        return rows
    finally:
        retriever.close()


def format_table(rows: list[QualityRow], datastore: Path) -> str:
    """One line per row under a header naming the questions, the datastore, k and nprobe."""

    def num(value: float | None, digits: int = 3) -> str:
        return "-" if value is None else f"{value:.{digits}f}"

    first = rows[0]
    form = {id(row): "" if row.form == "as written" else f" {row.form}" for row in rows}
    label = {id(row): row.pipeline + form[id(row)] + (" pipelined" if row.pipelining else "") for row in rows}
    width = max(13, *(len(text) + 1 for text in label.values()))
    lines = [
        f"{first.questions} questions, datastore {datastore}, k {first.k}, nprobe {first.nprobe} of {first.nlist} lists",
        f"{'pipeline':<{width}}{'recall@k':>9}{'exact':>7}{'EM':>7}{'F1':>7}{'cue':>5}{'overlap':>9}"
        f"{'prefetch':>10}{'pre-retr.':>11}{'search':>9}{'other LLM':>10}{'generate':>10}{'total ms':>10}"
        f"{'pipelined (again/checked/differed)':>36}{'search p50':>12}",
    ]
    for row in rows:
        ms, p = row.latency_ms, row.pipelined
        lines.append(
            f"{label[id(row)]:<{width}}{num(row.recall):>9}{num(row.recall_exact):>7}{num(row.exact_match):>7}{num(row.f1):>7}"
            f"{'-' if row.cue_answers is None else row.cue_answers:>5}{num(row.overlap_rate):>9}"
            f"{ms.prefetch:>10.1f}{ms.pre_retrieval:>11.1f}{ms.search:>9.1f}{ms.llm:>10.1f}{ms.generate:>10.1f}{ms.total:>10.1f}"
            + (f"{f'{p.retrievals} ({p.searched_again}/{p.checked}/{p.differed})':>36}" if row.pipelining else f"{'-':>36}")
            + f"{num(row.search_p50_ms, 1):>12}"
        )
    return "\n".join(lines)
