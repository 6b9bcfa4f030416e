"""FLARE (active retrieval): write the answer a sentence at a time; when any token of the
look-ahead sentence is less likely than a threshold, retrieve with that sentence (its unsure
tokens masked out) and write the sentence again with the new documents.

The look-ahead generation is the pre-retrieval call: while it runs, the clusters of what is
already written are prefetched. A look-ahead sentence whose every token is sure is kept as the
answer's next sentence, so the answer's time is split between `pre_retrieval` (sentences kept
from the look-ahead) and `generate` (sentences written again after a retrieval). With
`pipelining`, the search starts during the look-ahead, from its sure tokens so far, at the
first unsure token past the launch point.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from telerag.engines import StopFilter
from telerag.engines.types import Generation
from telerag.pipelines import prompts
from telerag.pipelines.pipelining import PartialGeneration, StaleQuery
from telerag.pipelines.prompts import Prompt
from telerag.pipelines.rag.base import PREFETCH, SEARCH, STANDALONE_QUESTION, RagPipeline, RunContext
from telerag.pipelines.replies import clean_reply
from telerag.pipelines.types import RetrievedPassage, Stage, StageRole, TokenEvent

MAX_SENTENCES = 4
SENTENCE_TOKENS = 40
THRESHOLD = 0.4  # a token whose probability is below this triggers retrieval
SENTENCE_STOPS = (".", "\n")

LOOKAHEAD_SENTENCE = Stage("lookahead_sentence", StageRole.PRE_RETRIEVAL)
SENTENCE = Stage("sentence", StageRole.GENERATE)  # a sentence written again with the documents its look-ahead retrieved


def unsure_query(engine, generation: Generation | PartialGeneration, threshold: float) -> str | None:
    """The sentence (or the part of it generated so far) with its low-probability tokens
    removed, or None if every token is sure."""
    sure = [t for t, lp in zip(generation.token_ids, generation.logprobs, strict=True) if math.exp(lp) >= threshold]
    if len(sure) == len(generation.token_ids):
        return None
    return engine.decode(sure).strip()


class FLARE(RagPipeline):
    name = "flare"
    description = "Generate sentence by sentence; retrieve when a look-ahead token's probability is low."
    stages = (STANDALONE_QUESTION, PREFETCH, LOOKAHEAD_SENTENCE, SEARCH, SENTENCE)
    llm_calls = 2 * MAX_SENTENCES  # look ahead, and write again when it retrieved, each sentence
    threshold = THRESHOLD

    async def body(self, ctx: RunContext) -> str:
        written = ""
        shown = StopFilter(ctx.options.stop)  # what the client sees: the client's stop strings end the whole answer
        for _ in range(MAX_SENTENCES):
            known = f"{ctx.query} {written}".strip()

            async def lookahead_sentence(written=written) -> Generation:
                prompt = prompts.answer(ctx.query, ctx.documents, written, instructions=ctx.options.instructions)
                reply = await self.llm(
                    ctx, LOOKAHEAD_SENTENCE, [prompt], max_tokens=SENTENCE_TOKENS, stop=SENTENCE_STOPS, logprobs=True
                )
                return reply[0]

            ctx.draft = written  # the answer so far, which the sentence written again follows
            sentence, documents = await self.lookahead(ctx, [known], lookahead_sentence, self.retrieval_query(ctx))
            text = sentence.text
            if documents:  # retrieval was triggered: write the sentence again with the new documents
                ctx.documents = documents[0]
                redo = await self.llm(
                    ctx,
                    SENTENCE,
                    [prompts.answer(ctx.query, ctx.documents, written, instructions=ctx.options.instructions)],
                    max_tokens=SENTENCE_TOKENS,
                    stop=SENTENCE_STOPS,
                )
                sentence, text = redo[0], redo[0].text
            piece = clean_reply(text, prompts.ANSWER_CUE)
            if piece:
                piece = piece + ("." if sentence.finish_reason == "stop" and not piece.endswith(".") else "")
                if released := shown.push(("" if not written else " ") + piece):
                    ctx.emit(TokenEvent(released))
                written = f"{written} {piece}".strip()
            if shown.stopped or not piece or sentence.finish_reason != "stop" or len(written.split()) > ctx.options.max_tokens:
                break
        if rest := shown.finish():
            ctx.emit(TokenEvent(rest))
        return shown.final

    def retrieval_query(self, ctx: RunContext) -> Callable[[Generation | PartialGeneration], list[str] | None]:
        """A look-ahead sentence's search, or its part so far (pipelined): its sure tokens with
        the question; None when every token is sure (no retrieval)."""

        def query(generation: Generation | PartialGeneration) -> list[str] | None:
            masked = unsure_query(self.engine, generation, self.threshold)
            return None if masked is None else [f"{ctx.query} {masked}".strip()]

        return query

    def stale_query(self, ctx: RunContext) -> StaleQuery:
        return self.retrieval_query(ctx)

    def documents_prompt(self, ctx: RunContext, documents: list[list[RetrievedPassage]]) -> Prompt:
        """The sentence written again: after the answer so far (`ctx.draft`)."""
        return prompts.answer(ctx.query, documents[0], ctx.draft, instructions=ctx.options.instructions)
