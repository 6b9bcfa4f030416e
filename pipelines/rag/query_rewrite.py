"""OpenAI's `rewrite_query` on a vector store search: the query asked about its topic, which the
follow-up rewrite's pre-retrieval call names (`RagPipeline.topic`) with the query as the
conversation ("How tall is Mount Everest? (Mount Everest)"). A run of its own, so that the server
admits, times and cancels it as any other engine call; it retrieves nothing (the store is searched
with what it answers)."""

from __future__ import annotations

from telerag.pipelines import prompts
from telerag.pipelines.rag.base import STANDALONE_QUESTION, STANDALONE_TOKENS, RagPipeline, RunContext
from telerag.pipelines.types import RunOptions

# a run's options: no passages in its prompt, no answer but the one short call (what admission costs it at)
REWRITE_OPTIONS = RunOptions(top_k=0, max_tokens=STANDALONE_TOKENS)


class QueryRewrite(RagPipeline):
    name = "rewrite_query"
    description = "A search's query asked about its topic, which one short LLM call names."
    stages = (STANDALONE_QUESTION,)
    llm_calls = 1

    async def body(self, ctx: RunContext) -> str:
        """The query to search (the result's `answer`): the query, then the topic in parentheses;
        the query as it is when the model names none (`topic`: an empty reply, one cut at the
        deadline, one of no letter or digit)."""
        return prompts.standalone(ctx.query, await self.topic(ctx, prompts.query_topic(ctx.query)))
