"""Naive RAG: retrieve with the question, then answer. q_in is q_out; there is no pre-retrieval call."""

from __future__ import annotations

from telerag.pipelines.rag.base import GENERATE, PREFETCH, SEARCH, STANDALONE_QUESTION, RagPipeline, RunContext


class Naive(RagPipeline):
    name = "naive"
    description = "Retrieve with the question, then answer."
    stages = (STANDALONE_QUESTION, PREFETCH, SEARCH, GENERATE)
    llm_calls = 1  # the answer

    async def body(self, ctx: RunContext) -> str:
        _, documents = await self.lookahead(ctx, [ctx.query], None, lambda _: [ctx.query])
        ctx.documents = documents[0]
        return await self.answer(ctx, ctx.documents)
