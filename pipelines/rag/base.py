"""What every RAG pipeline shares: the lookahead step (prefetch q_in, run the pre-retrieval LLM
call while the clusters copy, search q_out, release), traced LLM calls, the streamed answer,
and the result with its trace and timings.

A run goes on in its caller's task, its events handed to the caller's sink as they happen (no
task or queue of its own); cancelling it (a client went away) aborts its LLM call and releases
its prefetch in `finally`.

The run's state is its `RunContext` (`rag.run_context`); how a lookahead finds its documents is
the request's retrieval strategy (`rag.retrieval_step`: the default, pipelined, speculative),
chosen once when the run begins. It is long because its methods are one pipeline's building
blocks: the lookahead, the traced LLM calls and the streamed answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import functools
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, ClassVar, TypeVar, overload

from telerag.engines.types import Engine, Generation, Prefiller, SamplingParams, TokenChunk
from telerag.pipelines import prompts
from telerag.pipelines.errors import EngineLacksCapability
from telerag.pipelines.pipelining import ExpectedTokens, PipeliningConfig, StaleQuery
from telerag.pipelines.prompts import Prompt
from telerag.pipelines.rag.pipelined import Pipelined, PipelinedTools, budget_observed
from telerag.pipelines.rag.retrieval_step import SEARCH, RetrievalStrategy, SearchCall, Sequential
from telerag.pipelines.rag.run_context import RunContext, Traced
from telerag.pipelines.rag.speculative import Speculative
from telerag.pipelines.rag.summary import summarize
from telerag.pipelines.replies import ReplyStream, clean_reply
from telerag.pipelines.search_budget import SearchBudget
from telerag.pipelines.stats import GenerationStats
from telerag.pipelines.types import (
    EventSink,
    PrefetchTicket,
    RagResult,
    RetrievedPassage,
    Retriever,
    RunOptions,
    SearchQuery,
    Stage,
    StageRole,
    Step,
    TokenEvent,
    query_texts,
)

__all__ = ["GENERATE", "PREFETCH", "SEARCH", "STANDALONE_QUESTION", "RagPipeline", "RunContext", "merge_documents"]

T = TypeVar("T")


# An answer is one paragraph: a base model that goes on after it starts something else.
ANSWER_STOPS = ("\n\n",)

PRE_RETRIEVAL_SMOOTHING = 0.2  # weight of the newest pre-retrieval time in the pipeline's estimate

# The stages every pipeline has: the lookahead's prefetch and search, and the streamed answer;
# and first, when the question came with a conversation, its rewrite into a standalone question.
PREFETCH = Stage("prefetch", StageRole.PREFETCH)
GENERATE = Stage("generate", StageRole.GENERATE)
STANDALONE_QUESTION = Stage("standalone_question", StageRole.PRE_RETRIEVAL)
STANDALONE_TOKENS = 24  # a topic, on one line


class RagPipeline:
    """Base class. Subclasses set `name`, `description`, `stages`, `llm_calls` and write `body`."""

    name: ClassVar[str]
    description: ClassVar[str]
    stages: ClassVar[tuple[Stage, ...]]
    llm_calls: ClassVar[int]  # the most LLM calls one run makes; the server's admission estimates cost from it

    def __init__(
        self,
        engine: Engine,
        retriever: Retriever,
        *,
        pre_retrieval_ms: float | None = None,
        pipelining: PipeliningConfig | None = None,
        search_budget: SearchBudget | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        """`pre_retrieval_ms`: the expected time of this pipeline's pre-retrieval call, which its
        prefetch copies hide behind (t_LLM of TeleRAG §4.2; refined from every call it makes;
        None: no estimate until the first). `pipelining`: how a request with `pipelining` runs
        its retrievals (`pipelines.pipelining`); `search_budget`: the search-time model behind
        nprobe "auto", shared by the pipelines over one retriever. `clock`: seconds, for every
        time the run traces."""
        self.engine = engine
        self.prefiller = engine if isinstance(engine, Prefiller) else None  # speculative prefill's, if the engine can
        self.retriever = retriever
        self.pre_retrieval_ms = pre_retrieval_ms
        self.pipelining = pipelining or PipeliningConfig()
        self.search_budget = search_budget or SearchBudget()
        self.expected_tokens = ExpectedTokens()
        self.clock = clock

    async def body(self, ctx: RunContext) -> str:
        """Run the pipeline; return the final answer (already streamed as TokenEvents)."""
        raise NotImplementedError

    def over(self, retriever: Retriever) -> RagPipeline:
        """A copy retrieving from `retriever`, for one request: its LLM calls teach this pipeline's
        expected tokens as ever; the search-time model is the server datastore's, so not shared."""
        pipeline = copy.copy(self)
        pipeline.retriever = retriever
        pipeline.search_budget = SearchBudget()
        return pipeline

    async def run(self, query: str, options: RunOptions, emit: EventSink) -> RagResult:
        ctx = RunContext(
            query=query,
            options=options,
            pipeline=self.name,
            stages=self.stages,
            generate=self._engine_generate,
            retrieval=self.retrieval_strategy(options),
            clock=self.clock,
            started=self.clock(),
            emit=emit,
            snapshot=self.retriever.snapshot(),
        )
        answer = await self._conversation(ctx)
        return self._result(ctx, answer)

    async def _conversation(self, ctx: RunContext) -> str:
        """The body, on the question rewritten to stand alone when it came with a conversation
        (a follow-up: "What river runs through it?")."""
        try:
            if ctx.options.history:
                ctx.query = await self.standalone_question(ctx)
            answer = await self.body(ctx)
            await ctx.retrieval.finished()  # what ran beside the answer, normally done by now
            return answer
        finally:
            if ctx.carried is not None:  # no lookahead took it
                self.retriever.release(ctx.carried)
            ctx.retrieval.cancel()

    def retrieval_strategy(self, options: RunOptions) -> RetrievalStrategy:
        """How this request's lookaheads retrieve, chosen once (`rag.retrieval_step`): as the
        default does, or with speculative prefill, and pipelined over either. The search-time
        model learns from a request's searches only where it reads it (pipelined, nprobe "auto").
        Speculative prefill on an engine that cannot prefill is refused (`EngineLacksCapability`)."""
        search: SearchCall = self.retriever.search
        if options.pipelining and options.nprobe == "auto":
            search = budget_observed(search, self.search_budget, self.clock)
        strategy: RetrievalStrategy = Sequential(search)
        if options.speculative_prefill:
            if self.prefiller is None:
                raise EngineLacksCapability(f"speculative_prefill: the engine {self.engine.name} cannot prefill a prompt alone")
            strategy = Speculative(search, self.prefiller)
        if options.pipelining:
            tools = PipelinedTools(self.engine, self.retriever.embed, self.pipelining, self.search_budget, self.expected_tokens)
            strategy = Pipelined(search, tools, strategy)
        return strategy

    def _engine_generate(self, stage: Stage, prompts: list[str], params: SamplingParams) -> Awaitable[list[Generation]]:
        """A run's LLM calls as they are (`RunContext.generate`)."""
        return self.engine.generate(prompts, params)

    async def standalone_question(self, ctx: RunContext) -> str:
        """The last message made to stand alone, as LangChain's history-aware retriever and
        LlamaIndex's condense-question engine do: a pre-retrieval call names the conversation's
        topic, and the question is asked about it ("Who wrote it? (The Little Prince)"), with q_in
        (the message as asked) prefetched beside the call. The first lookahead without a
        pre-retrieval call of its own searches q_out (the standalone question) with that
        prefetch; one with its own releases it (its clusters stay cached)."""
        prompt = prompts.conversation_topic(ctx.options.history)
        named, ctx.carried = await self._beside(ctx, [ctx.query], lambda: self.topic(ctx, prompt))
        return prompts.standalone(ctx.query, named or "")

    async def topic(self, ctx: RunContext, prompt: Prompt) -> str:
        """The standalone question's call (`prompts.conversation_topic`, `prompts.query_topic`):
        the topic it names, on one line (the call stops at its end) and stripped; empty when the
        reply holds no letter or digit, so the question is asked as it is."""
        named = (await self.reply(ctx, STANDALONE_QUESTION, prompt, max_tokens=STANDALONE_TOKENS, stop=("\n",))).strip()
        return named if any(c.isalnum() for c in named) else ""

    # -- building blocks ------------------------------------------------------------------------

    async def llm(
        self,
        ctx: RunContext,
        stage: Stage,
        batch: Sequence[Prompt],
        *,
        max_tokens: int = 64,
        stop: Sequence[str] = (),
        logprobs: bool = False,
    ) -> list[Generation]:
        """A traced, non-streamed LLM call (greedy unless the request asks otherwise), stopped
        where each prompt's reply runs past itself (`Prompt.stops`) and at any of `stop`. The
        Generations are the engine's; `replies.clean_reply` gives the reply in one."""
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=ctx.options.temperature,
            top_p=ctx.options.top_p,
            stop=tuple(dict.fromkeys([*stop, *(s for p in batch for s in p.stops)])),
            logprobs=logprobs,
            deadline=ctx.options.deadline,
        )
        formatted = [self.engine.format_prompt(p.user, system=p.system) for p in batch]
        generations, start_ms, ms = await ctx.stage(stage, lambda: self._generate(ctx, stage, formatted, params))
        for prompt, text, generation in zip(batch, formatted, generations, strict=True):
            ctx.generated(generation.completion_tokens)
            ctx.called(stage, text, generation)
            ctx.steps.append(
                Step(
                    stage,
                    prompt.user[-200:],
                    generation.prompt_tokens,
                    generation.completion_tokens,
                    ms,
                    GenerationStats(generation.finish_reason, generation.ttft_ms),
                    start_ms,
                    generation.cached_tokens,
                )
            )
        return generations

    def _generate(self, ctx: RunContext, stage: Stage, prompts: list[str], params: SamplingParams) -> Awaitable[list[Generation]]:
        """The run's generations (`RunContext.generate`). Past the run's deadline, empty ones at
        once: the engine would stop them before their first token."""
        if ctx.past_deadline:
            return asyncio.sleep(0, [Generation("", 0, 0, "deadline", 0.0, 0.0, index=i) for i in range(len(prompts))])
        return ctx.generate(stage, prompts, params)

    async def reply(
        self, ctx: RunContext, stage: Stage, prompt: Prompt, *, max_tokens: int = 64, stop: Sequence[str] = ()
    ) -> str:
        """A traced LLM call's reply: its generation without a restated or repeated cue."""
        generation = (await self.llm(ctx, stage, [prompt], max_tokens=max_tokens, stop=stop))[0]
        return clean_reply(generation.text, prompt.cue)

    @overload
    async def lookahead(
        self,
        ctx: RunContext,
        q_in: Sequence[str],
        pre_retrieval: Callable[[], Awaitable[T]],
        q_out: Callable[[T], Sequence[SearchQuery] | None],
    ) -> tuple[T, list[list[RetrievedPassage]]]: ...

    @overload
    async def lookahead(
        self,
        ctx: RunContext,
        q_in: Sequence[str],
        pre_retrieval: None,
        q_out: Callable[[None], Sequence[SearchQuery] | None],
    ) -> tuple[None, list[list[RetrievedPassage]]]: ...

    async def lookahead(
        self,
        ctx: RunContext,
        q_in: Sequence[str],
        pre_retrieval: Callable[[], Awaitable[T]] | None,
        q_out: Callable[[Any], Sequence[SearchQuery] | None],
    ) -> tuple[T | None, list[list[RetrievedPassage]]]:
        """Start the pre-retrieval call at once and prefetch q_in's clusters beside it (embedding
        q_in, ranking centroids, issuing copies), then search q_out once both are done (no search
        when `q_out` returns None: the copies were speculative). The LLM never waits for the
        prefetch; the search waits for both. Without a pre-retrieval call, a follow-up's standalone
        question's prefetch (`ctx.carried`) is this one: its rewrite was the call it hid behind.

        How the documents are found is the request's retrieval strategy's (`ctx.retrieval`), given
        what the pipeline says of its lookaheads: `stale_query` (q_out from the call's text so far)
        is what a pipelined step searches during the call, `documents_prompt` (the prompt of the
        LLM call the documents go to) what a speculative step prefills from its provisional top-k."""
        stale = self.stale_query(ctx) if pre_retrieval is not None else None
        step = ctx.retrieval.step(ctx, stale, functools.partial(self.documents_prompt, ctx))
        carried, ctx.carried = ctx.carried, None
        if carried is not None and pre_retrieval is None:
            produced, ticket = None, carried
        else:
            if carried is not None:
                self.retriever.release(carried)
            prefetch = self._prefetch(ctx, q_in, beside_call=pre_retrieval is not None)
            call = None if pre_retrieval is None else step.around_call(pre_retrieval, prefetch)
            try:
                produced, ticket = await self._beside(ctx, q_in, call, prefetch)
            except BaseException:
                await step.abandon()
                raise
        try:
            wanted = q_out(produced)
            if wanted is None:
                return produced, []
            queries = [q for q in wanted if any(text.strip() for text in query_texts(q))] or [ctx.query]
            documents = await step.documents(queries, ticket)
        finally:
            await step.abandon()  # what the step started and nothing used: the step needed no search
            self.retriever.release(ticket)
        return produced, documents

    def stale_query(self, ctx: RunContext) -> StaleQuery | None:
        """How a lookahead's query is made from its pre-retrieval call's text so far, for pipelined
        retrieval (`rag.pipelined`); None, this default: the pipeline's calls say nothing to search
        before they end (only Iter-RetGen's, FLARE's and Iterative's do)."""
        return None

    def documents_prompt(self, ctx: RunContext, documents: list[list[RetrievedPassage]]) -> Prompt:
        """The prompt of the LLM call a lookahead's documents (one list per query) go to, for
        speculative prefill (`rag.speculative`); this default: an answer prompt over the first
        query's documents (the answer, a round or a draft: `generate_quietly`)."""
        return prompts.answer(ctx.query, documents[0], instructions=ctx.options.instructions)

    def _prefetch(self, ctx: RunContext, q_in: Sequence[str], *, beside_call: bool) -> asyncio.Future[Traced[PrefetchTicket]]:
        """q_in's prefetch, started now as a traced stage; its budget is the expected time of the
        pre-retrieval call it runs beside (nothing to hide copies behind without one: the search
        copies on demand)."""
        overlap_ms = self.pre_retrieval_ms if beside_call else 0.0
        return ctx.stage(
            PREFETCH, lambda: self.retriever.prefetch(list(q_in), enabled=ctx.options.prefetch, overlap_ms=overlap_ms)
        )

    async def _beside(
        self,
        ctx: RunContext,
        q_in: Sequence[str],
        pre_retrieval: Callable[[], Awaitable[T]] | None,
        prefetch: asyncio.Future[Traced[PrefetchTicket]] | None = None,
    ) -> tuple[T | None, PrefetchTicket]:
        """The pre-retrieval call started at once and q_in's prefetch beside it (`prefetch`, if
        started already), both done; the prefetch traced. The caller releases the ticket."""
        if prefetch is None:
            prefetch = self._prefetch(ctx, q_in, beside_call=pre_retrieval is not None)
        try:
            produced = None
            if pre_retrieval is not None:
                started = self.clock()
                produced = await pre_retrieval()
                self._observe_pre_retrieval((self.clock() - started) * 1e3)
            ticket, start_ms, ms = await asyncio.shield(prefetch)  # a cancelled request must not cancel it
        except BaseException:
            # Never cancelled mid-way (its clusters would stay pinned): released once it lands,
            # which is before the error leaves this call unless this call is cancelled again.
            if prefetch.done():
                self._release_unclaimed(prefetch)
            else:
                prefetch.add_done_callback(self._release_unclaimed)
                with contextlib.suppress(BaseException):
                    await asyncio.shield(prefetch)
            raise
        ctx.steps.append(Step(PREFETCH, " | ".join(q_in)[:200], ms=ms, stats=ticket.stats, start_ms=start_ms))
        return produced, ticket

    def _release_unclaimed(self, prefetch: asyncio.Future) -> None:
        """The ticket of a prefetch whose request failed or went away before its search."""
        if not prefetch.cancelled() and prefetch.exception() is None:
            self.retriever.release(prefetch.result()[0])

    def _observe_pre_retrieval(self, ms: float) -> None:
        """A moving average over this pipeline's calls, so the budget follows the model and load."""
        previous = self.pre_retrieval_ms
        self.pre_retrieval_ms = (
            ms if previous is None else (1 - PRE_RETRIEVAL_SMOOTHING) * previous + PRE_RETRIEVAL_SMOOTHING * ms
        )

    async def answer(
        self, ctx: RunContext, documents: Sequence[RetrievedPassage], *, prompt: Prompt | None = None, stage: Stage = GENERATE
    ) -> str:
        """The final answer, streamed to the client as it is generated: the text streamed is
        exactly the answer returned (see `replies.ReplyStream`), and generation ends as soon as
        the reply does (the cue repeated on the same line, which no stop string catches). Once the
        run's deadline has come, the answer is the run's latest draft (`generate_quietly`), if any."""
        if ctx.past_deadline:
            return self._answer_past_deadline(ctx, stage)
        prompt = prompt or prompts.answer(ctx.query, documents, instructions=ctx.options.instructions)
        params = SamplingParams(
            max_tokens=ctx.options.max_tokens,
            temperature=ctx.options.temperature,
            top_p=ctx.options.top_p,
            stop=tuple(dict.fromkeys([*prompt.stops, *ANSWER_STOPS, *ctx.options.stop])),
            deadline=ctx.options.deadline,
        )
        formatted = self.engine.format_prompt(prompt.user, system=prompt.system)
        reply = ReplyStream(prompt.cue)
        streamed = 0  # tokens accounted for as they came

        def on_chunk(chunk: TokenChunk) -> bool:
            """Each piece as the engine hands it over, on to the client: the reply's new text."""
            nonlocal streamed
            ctx.generated(len(chunk.token_ids))
            streamed += len(chunk.token_ids)
            if piece := reply.push(chunk.text):
                ctx.emit(TokenEvent(piece))
            return reply.complete  # the reply is over: the engine stops its generation

        started = ctx.begin(stage)
        final = (await self.engine.generate([formatted], params, on_chunk))[0]
        if piece := reply.finish():
            ctx.emit(TokenEvent(piece))
        start_ms, ms = ctx.end(stage, started)
        ctx.called(stage, formatted, final)
        ctx.generated(max(0, final.completion_tokens - streamed))  # chunks need not carry their token ids
        stats = GenerationStats(final.finish_reason, final.ttft_ms)
        ctx.steps.append(
            Step(stage, ctx.query[:200], final.prompt_tokens, final.completion_tokens, ms, stats, start_ms, final.cached_tokens)
        )
        return reply.text

    def _answer_past_deadline(self, ctx: RunContext, stage: Stage) -> str:
        """The latest draft (or nothing), streamed as the answer: the answer's call, begun past
        the deadline, would generate nothing. Traced as a call that stopped at the deadline."""
        started = ctx.begin(stage)
        if ctx.draft:
            ctx.emit(TokenEvent(ctx.draft))
        start_ms, ms = ctx.end(stage, started)
        ctx.steps.append(Step(stage, ctx.query[:200], ms=ms, stats=GenerationStats("deadline"), start_ms=start_ms))
        return ctx.draft

    async def generate_quietly(
        self, ctx: RunContext, stage: Stage, documents: Sequence[RetrievedPassage], draft: str = ""
    ) -> str:
        """An answer that is not streamed to the client (a round of Iter-RetGen, a draft of Iter
        or Self-RAG): the reply of an answer prompt, kept as the run's latest draft."""
        reply = await self.reply(
            ctx,
            stage,
            prompts.answer(ctx.query, documents, draft, instructions=ctx.options.instructions),
            max_tokens=ctx.options.max_tokens,
            stop=(*ANSWER_STOPS, *ctx.options.stop),
        )
        ctx.draft = reply or ctx.draft
        return reply

    # -- the result ---------------------------------------------------------------------------

    def _result(self, ctx: RunContext, answer: str) -> RagResult:
        timings, prefetch, pipelining, speculation = summarize(ctx.steps, total_ms=(self.clock() - ctx.started) * 1e3)
        return RagResult(
            answer=answer,
            pipeline=self.name,
            documents=ctx.documents,
            steps=sorted(ctx.steps, key=lambda step: step.start_ms),  # a prefetch is appended after the call beside it
            timings=timings,
            prefetch=prefetch,
            tokens_generated=ctx.tokens_generated,
            pipelining=pipelining,
            speculation=speculation,
        )


def merge_documents(groups: Sequence[Sequence[RetrievedPassage]], limit: int) -> list[RetrievedPassage]:
    """Unique documents across several result lists, best score first."""
    best: dict[tuple[str, int], RetrievedPassage] = {}
    for group in groups:
        for doc in group:
            key = (doc.source, doc.id)
            if key not in best or doc.score > best[key].score:
                best[key] = doc
    return sorted(best.values(), key=lambda d: (-d.score, d.source, d.id))[:limit]
