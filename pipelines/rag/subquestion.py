"""SubQuestion: decompose the question, retrieve for the question and every sub-question in one
batched search, answer. The question itself stays among the queries, so a decomposition that
drifts off it never loses what retrieving with the question finds."""

from __future__ import annotations

from telerag.pipelines import prompts
from telerag.pipelines.prompts import Prompt
from telerag.pipelines.rag.base import GENERATE, PREFETCH, SEARCH, STANDALONE_QUESTION, RagPipeline, RunContext, merge_documents
from telerag.pipelines.types import RetrievedPassage, Stage, StageRole

MAX_SUB_QUESTIONS = 4

DECOMPOSE = Stage("decompose", StageRole.PRE_RETRIEVAL)


def parse_sub_questions(text: str, limit: int = MAX_SUB_QUESTIONS) -> list[str]:
    lines = [line.strip().lstrip("-*0123456789.) ").strip() for line in text.splitlines()]
    return [line for line in lines if len(line) > 3][:limit]


def search_queries(question: str, sub_questions: list[str]) -> list[str]:
    """The question, then each sub-question once (a repeat differs only in case or spacing)."""
    seen: set[str] = set()
    queries = []
    for text in [question, *sub_questions]:
        key = " ".join(text.lower().split())
        if key not in seen:
            seen.add(key)
            queries.append(text)
    return queries


class SubQuestion(RagPipeline):
    name = "subquestion"
    description = "Decompose into sub-questions (pre-retrieval), retrieve them with the question as one batch, then answer."
    stages = (STANDALONE_QUESTION, PREFETCH, DECOMPOSE, SEARCH, GENERATE)
    llm_calls = 2  # decompose, answer

    async def body(self, ctx: RunContext) -> str:
        async def decompose() -> str:
            prompt = prompts.sub_questions(ctx.query, MAX_SUB_QUESTIONS)
            return await self.reply(ctx, DECOMPOSE, prompt, max_tokens=96)

        def queries(text: str) -> list[str]:
            return search_queries(ctx.query, parse_sub_questions(text))

        _, documents = await self.lookahead(ctx, [ctx.query], decompose, queries)
        ctx.documents = merge_documents(documents, ctx.options.top_k)
        return await self.answer(ctx, ctx.documents)

    def documents_prompt(self, ctx: RunContext, documents: list[list[RetrievedPassage]]) -> Prompt:
        """The answer's, over every query's documents merged."""
        return prompts.answer(ctx.query, merge_documents(documents, ctx.options.top_k), instructions=ctx.options.instructions)
