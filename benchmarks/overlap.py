"""The overlap study (TeleRAG Table 3.1): for each pipeline, how much of q_out's clusters the
prefetch of q_in already covered, and how long the pre-retrieval call ran (the time a prefetch
has to hide behind); beside it, how often the question's article was retrieved and how many
answers are empty or loop on the answer cue. `configured_overlap_study` runs it with the
configured LLM and datastore (`telerag bench overlap`)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from tqdm import tqdm

from telerag.config.settings import Settings
from telerag.pipelines.prompts import holds_answer_cue
from telerag.pipelines.questions import Question, run_questions
from telerag.pipelines.retriever import DirectRetriever
from telerag.pipelines.types import Pipeline, RunOptions, overlap_rates
from telerag.server.process.runtime import open_runtime


@dataclass
class OverlapRow:
    pipeline: str
    questions: int
    overlap_rate: float | None  # mean over searches of |C_in ∩ C_out| / |C_out|
    pre_retrieval_ms: float  # mean per question
    total_ms: float
    article_hit_rate: float | None  # share of questions whose article was among the documents (recall@top_k)
    empty_answers: int  # answers with no text (a model that only repeated the cue gives one)
    cue_answers: int  # answers that still hold the answer cue ("Answer:"): a reply looping on it


@dataclass(frozen=True)
class OverlapConfig:
    pipelines: tuple[str, ...]
    questions: tuple[Question, ...]
    prefetch_clusters: int | None = None  # prefetch depth in clusters of average size; None: nprobe
    nprobe: int | None = None  # None: the configured nprobe
    max_tokens: int = 64


@dataclass
class OverlapReport:
    """The study's rows and what they were measured at (its fields in the order of the `--json` line)."""

    questions: int
    nlist: int
    prefetch_clusters: int  # the prefetch depth the budget was set from
    nprobe: int
    rows: list[OverlapRow]


async def overlap_study(
    pipelines: Sequence[Pipeline], questions: Sequence[Question], options: RunOptions, *, progress: bool = False
) -> list[OverlapRow]:
    rows = []
    bar = tqdm(total=len(pipelines) * len(questions), desc="questions", unit="q", disable=not progress)
    for pipeline in pipelines:
        overlaps: list[float] = []
        pre_ms: list[float] = []
        total_ms: list[float] = []
        hits: list[bool] = []
        answers: list[str] = []
        bar.set_postfix_str(pipeline.name)
        async for question, result in run_questions(pipeline, questions, options):
            bar.update()
            answers.append(result.answer)
            overlaps.extend(overlap_rates(result.steps))
            pre_ms.append(result.timings.pre_retrieval_ms)
            total_ms.append(result.timings.total_ms)
            if question.title is not None:
                hits.append(question.title in {d.title for d in result.documents})
        rows.append(
            OverlapRow(
                pipeline=pipeline.name,
                questions=len(questions),
                overlap_rate=statistics.fmean(overlaps) if overlaps else None,
                pre_retrieval_ms=statistics.fmean(pre_ms),
                total_ms=statistics.fmean(total_ms),
                article_hit_rate=statistics.fmean(hits) if hits else None,
                empty_answers=sum(not answer for answer in answers),
                cue_answers=sum(map(holds_answer_cue, answers)),
            )
        )
    bar.close()
    return rows


async def configured_overlap_study(settings: Settings, config: OverlapConfig) -> OverlapReport:
    """`overlap_study` of the named pipelines with the configured LLM and datastore, with a
    progress bar; the prefetch budget holds `prefetch_clusters` clusters of average size."""
    retrieval = settings.retrieval
    # The plan needs a cache to plan into, even on a CPU: one that can hold the whole datastore
    # (the cache never allocates more than the datastore's size).
    retrieval = retrieval.model_copy(update={"cache_mb": retrieval.cache_mb or float(1 << 20)})
    async with open_runtime(settings.model_copy(update={"retrieval": retrieval})) as runtime:
        retriever = runtime.retriever
        if not isinstance(retriever, DirectRetriever):
            raise TypeError(f"the overlap study sets the prefetch budget of a DirectRetriever, not of {type(retriever).__name__}")
        info = runtime.datastore_info
        depth = config.prefetch_clusters or info.nprobe
        retriever.prefetch_budget_bytes = int(depth * retriever.retrieval_engine.cache.cluster_bytes().mean())
        pipelines = runtime.pipelines(retriever, config.pipelines)
        options = RunOptions(top_k=retrieval.top_k, nprobe=config.nprobe, max_tokens=config.max_tokens)
        rows = await overlap_study(list(pipelines.values()), config.questions, options, progress=True)
    return OverlapReport(
        questions=len(config.questions), nlist=info.nlist, prefetch_clusters=depth, nprobe=config.nprobe or info.nprobe, rows=rows
    )


def format_table(report: OverlapReport) -> str:
    """One line per pipeline under a header naming the questions, nlist, nprobe and the prefetch depth."""

    def num(value: float | None) -> str:
        return "-" if value is None else f"{value:.3f}"

    lines = [
        f"{report.questions} questions, nlist {report.nlist}, nprobe {report.nprobe}, "
        f"prefetch depth {report.prefetch_clusters} clusters",
        f"{'pipeline':<13}{'overlap':>9}{'pre-retrieval ms':>18}{'total ms':>10}{'article hit':>13}"
        f"{'empty answers':>15}{'cue answers':>13}",
    ]
    for row in report.rows:
        lines.append(
            f"{row.pipeline:<13}{num(row.overlap_rate):>9}{row.pre_retrieval_ms:>18.1f}{row.total_ms:>10.1f}"
            f"{num(row.article_hit_rate):>13}{row.empty_answers:>15}{row.cue_answers:>13}"
        )
    return "\n".join(lines)
