"""Self-RAG with prompted reflection (for a general model): decide whether to retrieve, answer,
critique whether the answer is supported; an unsupported answer is regenerated with the
documents in front of it, streamed. The first answer is the reply unless the critique rejects
it, so both answer calls are `generate` stages: a rejected one's time is part of the answer's."""

from __future__ import annotations

from telerag.pipelines import prompts
from telerag.pipelines.rag.base import PREFETCH, SEARCH, STANDALONE_QUESTION, RagPipeline, RunContext
from telerag.pipelines.types import Stage, StageRole, TokenEvent

DECIDE_RETRIEVAL = Stage("decide_retrieval", StageRole.PRE_RETRIEVAL)
FIRST_ANSWER = Stage("first_answer", StageRole.GENERATE)  # written quietly; shown unless the critique rejects it
CRITIQUE = Stage("critique", StageRole.LLM)
REVISED_ANSWER = Stage("revised_answer", StageRole.GENERATE)  # streamed, in place of a rejected first answer


class SelfRAG(RagPipeline):
    name = "self_rag"
    description = "Decide whether to retrieve (pre-retrieval), answer, critique support; regenerate if unsupported."
    stages = (STANDALONE_QUESTION, PREFETCH, DECIDE_RETRIEVAL, SEARCH, FIRST_ANSWER, CRITIQUE, REVISED_ANSWER)
    llm_calls = 4  # decide, draft, critique, revise

    async def body(self, ctx: RunContext) -> str:
        async def decide() -> bool:
            # Retrieve unless the model declines: one that cannot follow the instruction (a small
            # base model answers the question instead) still gets its documents.
            return not prompts.is_no(await self.reply(ctx, DECIDE_RETRIEVAL, prompts.needs_retrieval(ctx.query), max_tokens=3))

        # The question's clusters are prefetched while the model decides; if it decides
        # against retrieval the copies were speculative and no search runs.
        _, documents = await self.lookahead(ctx, [ctx.query], decide, lambda retrieve: [ctx.query] if retrieve else None)
        ctx.documents = documents[0] if documents else []
        draft = await self.generate_quietly(ctx, FIRST_ANSWER, ctx.documents)
        if ctx.documents:
            verdict = await self.reply(ctx, CRITIQUE, prompts.critique(ctx.query, ctx.documents, draft), max_tokens=3)
            if not prompts.is_yes(verdict):
                return await self.answer(
                    ctx,
                    ctx.documents,
                    prompt=prompts.revise(ctx.query, ctx.documents, draft, instructions=ctx.options.instructions),
                    stage=REVISED_ANSWER,
                )
        if draft:
            ctx.emit(TokenEvent(draft))
        return draft
