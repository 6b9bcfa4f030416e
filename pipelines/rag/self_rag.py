"""Self-RAG with prompted reflection (for a general model): decide whether to retrieve, answer,
critique whether the answer is supported; an unsupported answer is regenerated with the
documents in front of it, streamed."""

from __future__ import annotations

from telerag.pipelines import prompts
from telerag.pipelines.rag.base import GENERATE, PREFETCH, SEARCH, RagPipeline, RunContext, Stage
from telerag.pipelines.types import TokenEvent


class SelfRAG(RagPipeline):
    name = "self_rag"
    description = "Decide whether to retrieve (pre-retrieval), answer, critique support; regenerate if unsupported."
    stages = (PREFETCH, Stage("decide_retrieval", "pre_retrieval"), SEARCH, Stage("critique", "llm"), GENERATE)
    llm_calls = 4  # decide, draft, critique, revise

    async def body(self, ctx: RunContext) -> str:
        async def decide() -> bool:
            # Retrieve unless the model declines: one that cannot follow the instruction (a small
            # base model answers the question instead) still gets its documents.
            return not prompts.is_no(await self.reply(ctx, "decide_retrieval", prompts.needs_retrieval(ctx.query), max_tokens=3))

        # The question's clusters are prefetched while the model decides; if it decides
        # against retrieval the copies were speculative and no search runs.
        _, documents = await self.lookahead(ctx, [ctx.query], decide, lambda retrieve: [ctx.query] if retrieve else None)
        ctx.documents = documents[0] if documents else []
        draft = await self.generate_quietly(ctx, "draft_answer", ctx.documents)
        if ctx.documents:
            verdict = await self.reply(ctx, "critique", prompts.critique(ctx.query, ctx.documents, draft), max_tokens=3)
            if not prompts.is_yes(verdict):
                return await self.answer(ctx, ctx.documents, prompt=prompts.revise(ctx.query, ctx.documents, draft))
        if draft:
            ctx.events.put_nowait(TokenEvent(draft))
        return draft
