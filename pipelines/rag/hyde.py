"""HyDE: write a hypothetical passage that would answer the question, retrieve with the mean of
the question's and the passage's embeddings (as the HyDE paper does), answer. The question
keeps the search anchored when a small model's passage drifts off it."""

from __future__ import annotations

from telerag.pipelines import prompts
from telerag.pipelines.rag.base import GENERATE, PREFETCH, SEARCH, STANDALONE_QUESTION, RagPipeline, RunContext
from telerag.pipelines.types import MeanQuery, SearchQuery, Stage, StageRole

HYPOTHETICAL_PASSAGE = Stage("hypothetical_passage", StageRole.PRE_RETRIEVAL)


class HyDE(RagPipeline):
    name = "hyde"
    description = "Generate a hypothetical passage (pre-retrieval), retrieve with it and the question, then answer."
    stages = (STANDALONE_QUESTION, PREFETCH, HYPOTHETICAL_PASSAGE, SEARCH, GENERATE)
    llm_calls = 2  # passage, answer

    async def body(self, ctx: RunContext) -> str:
        async def passage() -> str:
            return await self.reply(ctx, HYPOTHETICAL_PASSAGE, prompts.hypothetical_passage(ctx.query), max_tokens=96)

        def query(passage: str) -> list[SearchQuery]:
            return [MeanQuery((ctx.query, passage)) if passage else ctx.query]

        _, documents = await self.lookahead(ctx, [ctx.query], passage, query)
        ctx.documents = documents[0]
        return await self.answer(ctx, ctx.documents)
