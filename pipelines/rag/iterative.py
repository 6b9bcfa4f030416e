"""Iterative (Iter): ask a narrower search question, retrieve with it and the question (the mean
of their embeddings, so the search keeps the question in view), answer, judge; stop when the
judge says the answer is good enough (or after a few iterations). With `pipelining`, each
search starts from the narrower question so far while the rest of it is written."""

from __future__ import annotations

from telerag.pipelines import prompts
from telerag.pipelines.pipelining import StaleQuery
from telerag.pipelines.prompts import Prompt
from telerag.pipelines.rag.base import GENERATE, PREFETCH, SEARCH, STANDALONE_QUESTION, RagPipeline, RunContext, merge_documents
from telerag.pipelines.replies import clean_reply
from telerag.pipelines.types import MeanQuery, RetrievedPassage, SearchQuery, Stage, StageRole

MAX_ITERATIONS = 3

NARROW_QUESTION = Stage("narrow_question", StageRole.PRE_RETRIEVAL)
DRAFT_ANSWER = Stage("draft_answer", StageRole.LLM)  # for the judge; never shown
JUDGE = Stage("judge", StageRole.LLM)


class Iterative(RagPipeline):
    name = "iterative"
    description = "Narrower question (pre-retrieval), retrieve, answer, judge; repeat until judged sufficient."
    stages = (STANDALONE_QUESTION, PREFETCH, NARROW_QUESTION, SEARCH, DRAFT_ANSWER, JUDGE, GENERATE)
    llm_calls = 3 * MAX_ITERATIONS - 1  # narrow each iteration; draft and judge all but the last; answer

    async def body(self, ctx: RunContext) -> str:
        notes = ""
        q_in = ctx.query
        gathered: list[list[RetrievedPassage]] = []
        for iteration in range(MAX_ITERATIONS):

            async def narrow(notes=notes) -> str:
                return await self.reply(
                    ctx, NARROW_QUESTION, prompts.narrower_question(ctx.query, notes), max_tokens=32, stop=("\n",)
                )

            question, documents = await self.lookahead(ctx, [q_in], narrow, lambda narrower: narrowed(ctx.query, narrower))
            gathered.append(documents[0])
            ctx.documents = merge_documents(gathered, ctx.options.top_k)
            if iteration == MAX_ITERATIONS - 1:
                break
            draft = await self.generate_quietly(ctx, DRAFT_ANSWER, ctx.documents)
            if prompts.is_yes(await self.reply(ctx, JUDGE, prompts.judge(ctx.query, draft), max_tokens=3)):
                break
            notes, q_in = draft, question or ctx.query
        return await self.answer(ctx, ctx.documents)

    def stale_query(self, ctx: RunContext) -> StaleQuery:
        """The search from the narrower question so far."""
        return lambda partial: narrowed(ctx.query, clean_reply(partial.text, prompts.SEARCH_QUESTION_CUE))

    def documents_prompt(self, ctx: RunContext, documents: list[list[RetrievedPassage]]) -> Prompt:
        """The draft's, or the answer's after the last search: over the documents gathered so far
        (`ctx.documents`, their top_k, which holds the top_k of them all) and the new ones."""
        merged = merge_documents([ctx.documents, documents[0]], ctx.options.top_k)
        return prompts.answer(ctx.query, merged, instructions=ctx.options.instructions)


def narrowed(question: str, narrower: str) -> list[SearchQuery]:
    """The search of a narrower question: the mean of its embedding and the question's."""
    return [MeanQuery((question, narrower)) if narrower else question]
