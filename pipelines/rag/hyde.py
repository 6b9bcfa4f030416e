"""HyDE: write a hypothetical passage that would answer the question, retrieve with it, answer."""

from __future__ import annotations

from telerag.pipelines import prompts
from telerag.pipelines.rag.base import GENERATE, PREFETCH, SEARCH, RagPipeline, RunContext, Stage


class HyDE(RagPipeline):
    name = "hyde"
    description = "Generate a hypothetical passage (pre-retrieval), retrieve with it, then answer."
    stages = (PREFETCH, Stage("hypothetical_passage", "pre_retrieval"), SEARCH, GENERATE)
    llm_calls = 2  # passage, answer

    async def body(self, ctx: RunContext) -> str:
        async def passage():
            return (await self.llm(ctx, "hypothetical_passage", [prompts.hypothetical_passage(ctx.query)], max_tokens=96))[0]

        _, documents = await self.lookahead(ctx, [ctx.query], passage, lambda g: [g.text])
        ctx.documents = documents[0]
        return await self.answer(ctx, ctx.documents)
