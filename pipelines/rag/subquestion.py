"""SubQuestion: decompose the question, retrieve for every sub-question in one batched search, answer."""

from __future__ import annotations

from telerag.pipelines import prompts
from telerag.pipelines.rag.base import GENERATE, PREFETCH, SEARCH, RagPipeline, RunContext, Stage, merge_documents

MAX_SUB_QUESTIONS = 4


def parse_sub_questions(text: str, limit: int = MAX_SUB_QUESTIONS) -> list[str]:
    lines = [line.strip().lstrip("-*0123456789.) ").strip() for line in text.splitlines()]
    return [line for line in lines if len(line) > 3][:limit]


class SubQuestion(RagPipeline):
    name = "subquestion"
    description = "Decompose into sub-questions (pre-retrieval), retrieve them as one batch, then answer."
    stages = (PREFETCH, Stage("decompose", "pre_retrieval"), SEARCH, GENERATE)
    llm_calls = 2  # decompose, answer

    async def body(self, ctx: RunContext) -> str:
        async def decompose():
            prompt = prompts.sub_questions(ctx.query, MAX_SUB_QUESTIONS)
            return (await self.llm(ctx, "decompose", [prompt], max_tokens=96))[0]

        _, documents = await self.lookahead(
            ctx, [ctx.query], decompose, lambda g: parse_sub_questions(g.text) or [ctx.query]
        )
        ctx.documents = merge_documents(documents, ctx.options.top_k)
        return await self.answer(ctx, ctx.documents)
