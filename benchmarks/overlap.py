"""The overlap study (TeleRAG Table 3.1): for each pipeline, how much of q_out's clusters the
prefetch of q_in already covered, and how long the pre-retrieval call ran (the time a prefetch
has to hide behind); beside it, how often the question's article was retrieved and how many
answers are empty or loop on the answer cue."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from tqdm import tqdm

from telerag.pipelines.prompts import ANSWER_CUE
from telerag.pipelines.questions import Question, run_questions
from telerag.pipelines.types import Pipeline, RunOptions, overlap_rates


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
        rows.append(OverlapRow(
            pipeline=pipeline.name,
            questions=len(questions),
            overlap_rate=statistics.fmean(overlaps) if overlaps else None,
            pre_retrieval_ms=statistics.fmean(pre_ms),
            total_ms=statistics.fmean(total_ms),
            article_hit_rate=statistics.fmean(hits) if hits else None,
            empty_answers=sum(not answer for answer in answers),
            cue_answers=sum(ANSWER_CUE in answer for answer in answers),
        ))
    bar.close()
    return rows
