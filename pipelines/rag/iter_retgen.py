"""Iter-RetGen: three rounds of retrieve -> generate; each round's answer joins the next query.

The generation of round r is the pre-retrieval call of round r+1: while it runs, the clusters
of what is already known (question + the previous answer) are prefetched; with `pipelining`,
round r+1's search starts from the answer so far while the rest of it is written.
"""

from __future__ import annotations

from telerag.pipelines import prompts
from telerag.pipelines.pipelining import StaleQuery
from telerag.pipelines.rag.base import GENERATE, PREFETCH, SEARCH, STANDALONE_QUESTION, RagPipeline, RunContext
from telerag.pipelines.replies import clean_reply
from telerag.pipelines.types import Stage, StageRole

ROUNDS = 3

ROUND_ANSWER = Stage("round_answer", StageRole.PRE_RETRIEVAL)  # the next round's query is made of it


class IterRetGen(RagPipeline):
    name = "iter_retgen"
    description = "Three rounds of retrieval and generation; each answer refines the next retrieval."
    stages = (STANDALONE_QUESTION, PREFETCH, ROUND_ANSWER, SEARCH, GENERATE)
    llm_calls = ROUNDS  # a quiet answer each round but the last, then the answer

    async def body(self, ctx: RunContext) -> str:
        _, documents = await self.lookahead(ctx, [ctx.query], None, lambda _: [ctx.query])
        ctx.documents = documents[0]
        draft = ""
        for _ in range(ROUNDS - 1):
            known = f"{ctx.query} {draft}".strip()
            docs_so_far = ctx.documents

            async def round_answer(docs=docs_so_far) -> str:
                return await self.generate_quietly(ctx, ROUND_ANSWER, docs)

            draft, documents = await self.lookahead(ctx, [known], round_answer, lambda text: [f"{ctx.query} {text}"])
            ctx.documents = documents[0]
        return await self.answer(ctx, ctx.documents)

    def stale_query(self, ctx: RunContext) -> StaleQuery:
        """A round's query from its answer so far."""
        return lambda partial: [f"{ctx.query} {clean_reply(partial.text, prompts.ANSWER_CUE)}"]
