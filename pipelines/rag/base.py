"""What every RAG pipeline shares: the lookahead step (prefetch q_in, run the pre-retrieval LLM
call while the clusters copy, search q_out, release), traced LLM calls, the streamed answer,
and the result with its trace and timings.

A pipeline's body runs as a task that pushes events onto a queue; `run` yields them. Closing
the `run` generator (a client went away) cancels the body, which aborts its LLM call and
releases its prefetch in `finally`.

It is long because these steps share one run's context and trace and are one pipeline's
building blocks: the lookahead (prefetch, pre-retrieval call and search, pipelined or not:
`rag.pipelined`), the traced LLM calls and the streamed answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar, overload

from telerag.pipelines import prompts
from telerag.pipelines.errors import UndeclaredStage
from telerag.pipelines.pipelining import ExpectedTokens, PartialGeneration, PipeliningConfig, StaleQuery, watched_generations
from telerag.pipelines.prompts import Prompt
from telerag.pipelines.rag.pipelined import PipelinedStep
from telerag.pipelines.rag.summary import summarize
from telerag.pipelines.replies import ReplyStream, clean_reply
from telerag.pipelines.search_budget import SearchBudget
from telerag.pipelines.speculation import Speculation
from telerag.pipelines.stats import GenerationStats
from telerag.pipelines.types import (
    Document,
    Engine,
    Generation,
    OnProvisional,
    PrefetchTicket,
    RagResult,
    ResultEvent,
    Retriever,
    RunEvent,
    RunOptions,
    SamplingParams,
    SearchOptions,
    SearchOutcome,
    SearchQuery,
    Stage,
    StageEvent,
    StageRole,
    Step,
    TokenEvent,
    UsageEvent,
    deadline_passed,
    query_texts,
)

if TYPE_CHECKING:
    from telerag.retrieval.snapshot import Snapshot

T = TypeVar("T")
Traced = tuple[T, float, float]  # a traced stage's result, when it started (ms after the request) and how long it took (ms)
NextPrompt = Callable[[list[list[Document]]], Prompt]  # the prompt of the LLM call a search's documents go to


# An answer is one paragraph: a base model that goes on after it starts something else.
ANSWER_STOPS = ("\n\n",)

PRE_RETRIEVAL_SMOOTHING = 0.2  # weight of the newest pre-retrieval time in the pipeline's estimate

# The stages every pipeline has: the lookahead's prefetch and search, and the streamed answer;
# and first, when the question came with a conversation, its rewrite into a standalone question.
PREFETCH = Stage("prefetch", StageRole.PREFETCH)
SEARCH = Stage("search", StageRole.SEARCH)
GENERATE = Stage("generate", StageRole.GENERATE)
STANDALONE_QUESTION = Stage("standalone_question", StageRole.PRE_RETRIEVAL)
STANDALONE_TOKENS = 24  # a topic, on one line


@dataclass
class RunContext:
    query: str
    options: RunOptions
    started: float  # the pipeline's clock when the run began
    events: asyncio.Queue[RunEvent | None] = field(default_factory=asyncio.Queue)  # None: the body ended
    steps: list[Step] = field(default_factory=list)
    documents: list[Document] = field(default_factory=list)
    tokens_generated: int = 0
    carried: PrefetchTicket | None = None  # the standalone question's prefetch, for the first lookahead to use
    watch: Callable[[PartialGeneration], None] | None = None  # a pipelined lookahead's, during its pre-retrieval call
    checks: list[asyncio.Future[None]] = field(default_factory=list)  # pipelined searches checked beside the run
    speculations: list[Speculation] = field(default_factory=list)  # speculative prefills of the calls after searches
    draft: str = ""  # the latest quiet answer with any text: the answer, should the deadline come before the last
    snapshot: Snapshot | None = None  # the datastore every retrieval of the run reads, taken when it began

    def search_options(self, nprobe: int | None) -> SearchOptions:
        """A search of this run: the request's top_k and prefetch, over the run's snapshot."""
        return SearchOptions(top_k=self.options.top_k, nprobe=nprobe, prefetch=self.options.prefetch, snapshot=self.snapshot)

    @property
    def past_deadline(self) -> bool:
        """Whether the run's deadline (`RunOptions.deadline`) has come: its LLM calls generate nothing more."""
        return deadline_passed(self.options.deadline)

    def generated(self, tokens: int) -> None:
        """Account for `tokens` newly generated tokens (in the result, and at once as a UsageEvent)."""
        if tokens:
            self.tokens_generated += tokens
            self.events.put_nowait(UsageEvent(tokens))


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
        self.retriever = retriever
        self.pre_retrieval_ms = pre_retrieval_ms
        self.pipelining = pipelining or PipeliningConfig()
        self.search_budget = search_budget or SearchBudget()
        self.expected_tokens = ExpectedTokens()
        self.clock = clock

    async def body(self, ctx: RunContext) -> str:
        """Run the pipeline; return the final answer (already streamed as TokenEvents)."""
        raise NotImplementedError

    async def run(self, query: str, options: RunOptions) -> AsyncGenerator[RunEvent, None]:
        ctx = RunContext(query=query, options=options, started=self.clock(), snapshot=self.retriever.snapshot())
        task = asyncio.create_task(self._conversation(ctx))
        # The body's end is queued behind every event it queued, so one `get` per event suffices.
        task.add_done_callback(lambda _: ctx.events.put_nowait(None))
        try:
            while (event := await ctx.events.get()) is not None:
                yield event
            answer = task.result()  # raises the body's error
            yield ResultEvent(self._result(ctx, answer))
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    async def _conversation(self, ctx: RunContext) -> str:
        """The body, on the question rewritten to stand alone when it came with a conversation
        (a follow-up: "What river runs through it?")."""
        try:
            if ctx.options.history:
                ctx.query = await self.standalone_question(ctx)
            answer = await self.body(ctx)
            await asyncio.gather(*ctx.checks)  # beside the answer, normally done by now
            await asyncio.gather(*(speculation.finished() for speculation in ctx.speculations))
            return answer
        finally:
            if ctx.carried is not None:  # no lookahead took it
                self.retriever.release(ctx.carried)
            for check in ctx.checks:
                check.cancel()
            for speculation in ctx.speculations:
                speculation.cancel()

    async def standalone_question(self, ctx: RunContext) -> str:
        """The last message made to stand alone, as LangChain's history-aware retriever and
        LlamaIndex's condense-question engine do: a pre-retrieval call names the conversation's
        topic, and the question is asked about it ("Who wrote it? (The Little Prince)"), with q_in
        (the message as asked) prefetched beside the call. The first lookahead without a
        pre-retrieval call of its own searches q_out (the standalone question) with that
        prefetch; one with its own releases it (its clusters stay cached)."""
        prompt = prompts.conversation_topic(ctx.options.history)

        async def topic() -> str:
            return await self.reply(ctx, STANDALONE_QUESTION, prompt, max_tokens=STANDALONE_TOKENS, stop=("\n",))

        named, ctx.carried = await self._beside(ctx, [ctx.query], topic)
        return prompts.standalone(ctx.query, (named or "").strip())

    # -- building blocks ------------------------------------------------------------------------

    def begin(self, ctx: RunContext, stage: Stage) -> float:
        """A declared stage begins: its start event is sent; the clock's time it began."""
        if stage not in self.stages:
            raise UndeclaredStage(
                f"pipeline {self.name} traced stage {stage.name!r} ({stage.role.value}), which it does not declare"
            )
        ctx.events.put_nowait(StageEvent(stage, "start"))
        return self.clock()

    def end(self, ctx: RunContext, stage: Stage, started: float) -> tuple[float, float]:
        """A stage that began at `started` ends: its end event is sent; when it began (ms after
        the request did) and how long it took (ms)."""
        ms = (self.clock() - started) * 1e3
        ctx.events.put_nowait(StageEvent(stage, "end", ms))
        return (started - ctx.started) * 1e3, ms

    def stage(self, ctx: RunContext, stage: Stage, work: Callable[[], Awaitable[T]]) -> asyncio.Future[Traced[T]]:
        """Start `work()` as a traced stage: its start event and time are taken now, so stages
        started side by side are traced in the order they were started. The task gives the
        result, when the stage started (ms after the request did) and how long it took (ms)."""
        started = self.begin(ctx, stage)
        pending = work()

        async def traced() -> tuple[T, float, float]:
            result = await pending
            return (result, *self.end(ctx, stage, started))

        return asyncio.ensure_future(traced())

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
        generations, start_ms, ms = await self.stage(ctx, stage, lambda: self._generate(ctx, stage, formatted, params))
        for prompt, text, generation in zip(batch, formatted, generations, strict=True):
            ctx.generated(generation.completion_tokens)
            if generation.finish_reason != "deadline":  # one cut short shows neither its length nor the engine's cache
                for speculation in ctx.speculations:
                    speculation.observe_call(text, generation)
                self.expected_tokens.observe(stage.name, generation.completion_tokens)
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
        """The engine's generations; streamed, each partial shown to `ctx.watch`, during a
        pipelined lookahead's pre-retrieval call (the same generations either way). Past the
        run's deadline, empty ones at once: the engine would stop them before their first token."""
        if ctx.past_deadline:
            return asyncio.sleep(0, [Generation("", 0, 0, "deadline", 0.0, 0.0, index=i) for i in range(len(prompts))])
        if ctx.watch is None:
            return self.engine.generate(prompts, params)
        expected = self.expected_tokens.of(stage.name, params.max_tokens)
        return watched_generations(self.engine.stream(prompts, params), len(prompts), expected, ctx.watch, self.clock)

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
        stale: StaleQuery | None = None,
        next_prompt: NextPrompt | None = None,
    ) -> tuple[T, list[list[Document]]]: ...

    @overload
    async def lookahead(
        self,
        ctx: RunContext,
        q_in: Sequence[str],
        pre_retrieval: None,
        q_out: Callable[[None], Sequence[SearchQuery] | None],
        stale: None = None,
        next_prompt: NextPrompt | None = None,
    ) -> tuple[None, list[list[Document]]]: ...

    async def lookahead(
        self,
        ctx: RunContext,
        q_in: Sequence[str],
        pre_retrieval: Callable[[], Awaitable[T]] | None,
        q_out: Callable[[Any], Sequence[SearchQuery] | None],
        stale: StaleQuery | None = None,
        next_prompt: NextPrompt | None = None,
    ) -> tuple[T | None, list[list[Document]]]:
        """Start the pre-retrieval call at once and prefetch q_in's clusters beside it (embedding
        q_in, ranking centroids, issuing copies), then search q_out once both are done (no search
        when `q_out` returns None: the copies were speculative). The LLM never waits for the
        prefetch; the search waits for both. Without a pre-retrieval call, a follow-up's standalone
        question's prefetch (`ctx.carried`) is this one: its rewrite was the call it hid behind.

        With `stale` (q_out from the call's text so far) and a request with `pipelining`, the
        search starts during the call instead, from the stale query at the launch point, and the
        final query decides after it whether those documents are used (`PipelinedStep.use`).

        With `next_prompt` (the prompt of the LLM call the documents go to) and a request with
        `speculative_prefill`, a search the run waits for prefills that prompt from its
        provisional top-k while it runs (`pipelines.speculation`)."""
        carried, ctx.carried = ctx.carried, None
        pipelined: PipelinedStep | None = None
        if carried is not None and pre_retrieval is None:
            produced, ticket = None, carried
        else:
            if carried is not None:
                self.retriever.release(carried)
            prefetch = self._prefetch(ctx, q_in, beside_call=pre_retrieval is not None)
            if stale is not None and pre_retrieval is not None and ctx.options.pipelining:
                pipelined = PipelinedStep(self, ctx, stale, prefetch)
                pre_retrieval = pipelined.watching(pre_retrieval)
            try:
                produced, ticket = await self._beside(ctx, q_in, pre_retrieval, prefetch)
            except BaseException:
                if pipelined is not None:
                    await pipelined.abandon()
                raise
        try:
            wanted = q_out(produced)
            if wanted is None:
                return produced, []
            queries = [q for q in wanted if any(text.strip() for text in query_texts(q))] or [ctx.query]
            if pipelined is not None and pipelined.search is not None:
                documents = await pipelined.use(queries, ticket)
            else:
                speculation = self._speculation(ctx, next_prompt)
                outcome, step = await self.search_traced(
                    ctx, queries, ticket, self.fixed_nprobe(ctx), None if speculation is None else speculation.start
                )
                documents = outcome.documents
                if speculation is not None:
                    speculation.settle(documents, step)
        finally:
            if pipelined is not None:
                await pipelined.abandon()  # a search nothing used: the step needed none
            self.retriever.release(ticket)
        return produced, documents

    def _speculation(self, ctx: RunContext, next_prompt: NextPrompt | None) -> Speculation | None:
        """A speculative prefill of `next_prompt` for a request that asks for one."""
        if next_prompt is None or not ctx.options.speculative_prefill:
            return None

        def formatted(documents: list[list[Document]]) -> str:
            prompt = next_prompt(documents)
            return self.engine.format_prompt(prompt.user, system=prompt.system)

        speculation = Speculation(self.engine, formatted)
        ctx.speculations.append(speculation)
        return speculation

    def answer_prompt(self, ctx: RunContext, draft: str = "") -> NextPrompt:
        """`next_prompt` for a search whose first query's documents go to an answer prompt (the
        answer, a round or a draft: `generate_quietly`)."""
        return lambda documents: prompts.answer(ctx.query, documents[0], draft, instructions=ctx.options.instructions)

    def fixed_nprobe(self, ctx: RunContext) -> int | None:
        """The nprobe of a search that overlaps no generation: the request's number, or the
        default (None) for "auto", which has nothing to fit inside."""
        return ctx.options.nprobe if isinstance(ctx.options.nprobe, int) else None

    async def search_traced(
        self,
        ctx: RunContext,
        queries: Sequence[SearchQuery],
        ticket: PrefetchTicket | None,
        nprobe: int | None,
        provisional: OnProvisional | None = None,
    ) -> tuple[SearchOutcome, Step]:
        """A traced search; its time, nprobe and the searches in flight beside it teach the
        search-time model. `provisional` as `Retriever.search`'s."""
        options = ctx.search_options(nprobe)
        outcome, start_ms, ms = await self.stage(ctx, SEARCH, lambda: self.search_timed(queries, options, ticket, provisional))
        step = Step(SEARCH, " | ".join(map(str, queries))[:200], ms=ms, stats=outcome.stats, start_ms=start_ms)
        ctx.steps.append(step)
        return outcome, step

    async def search_timed(
        self,
        queries: Sequence[SearchQuery],
        options: SearchOptions,
        ticket: PrefetchTicket | None,
        provisional: OnProvisional | None = None,
    ) -> SearchOutcome:
        with self.search_budget.searching() as depth:
            started = self.clock()
            outcome = await self.retriever.search(queries, options, ticket, provisional=provisional)
            self.search_budget.observe(outcome.stats.nprobe, depth, (self.clock() - started) * 1e3)
        return outcome

    def _prefetch(self, ctx: RunContext, q_in: Sequence[str], *, beside_call: bool) -> asyncio.Future[Traced[PrefetchTicket]]:
        """q_in's prefetch, started now as a traced stage; its budget is the expected time of the
        pre-retrieval call it runs beside (nothing to hide copies behind without one: the search
        copies on demand)."""
        overlap_ms = self.pre_retrieval_ms if beside_call else 0.0
        return self.stage(
            ctx, PREFETCH, lambda: self.retriever.prefetch(list(q_in), enabled=ctx.options.prefetch, overlap_ms=overlap_ms)
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
            # which is normally before the error leaves this call.
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
        self, ctx: RunContext, documents: Sequence[Document], *, prompt: Prompt | None = None, stage: Stage = GENERATE
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
        started = self.begin(ctx, stage)
        final: Generation | None = None
        streamed = 0  # tokens accounted for as they came
        async with contextlib.aclosing(self.engine.stream([formatted], params)) as stream:
            async for item in stream:
                if isinstance(item, Generation):
                    final = item
                    continue
                ctx.generated(len(item.token_ids))
                streamed += len(item.token_ids)
                if piece := reply.push(item.text):
                    ctx.events.put_nowait(TokenEvent(piece))
                if reply.complete:
                    break  # closing the stream aborts the generation
        if piece := reply.finish():
            ctx.events.put_nowait(TokenEvent(piece))
        start_ms, ms = self.end(ctx, stage, started)
        if final is not None:
            for speculation in ctx.speculations:
                speculation.observe_call(formatted, final)
            prompt_tokens, completion_tokens, cached = final.prompt_tokens, final.completion_tokens, final.cached_tokens
            stats = GenerationStats(final.finish_reason, final.ttft_ms)
        else:  # stopped here, when the reply was over (what the engine's cache held is not known)
            prompt_tokens, completion_tokens, cached = self.engine.count_tokens(formatted), streamed, 0
            stats = GenerationStats("stop")
        ctx.generated(max(0, completion_tokens - streamed))  # chunks need not carry their token ids
        ctx.steps.append(Step(stage, ctx.query[:200], prompt_tokens, completion_tokens, ms, stats, start_ms, cached))
        return reply.text

    def _answer_past_deadline(self, ctx: RunContext, stage: Stage) -> str:
        """The latest draft (or nothing), streamed as the answer: the answer's call, begun past
        the deadline, would generate nothing. Traced as a call that stopped at the deadline."""
        started = self.begin(ctx, stage)
        if ctx.draft:
            ctx.events.put_nowait(TokenEvent(ctx.draft))
        start_ms, ms = self.end(ctx, stage, started)
        ctx.steps.append(Step(stage, ctx.query[:200], ms=ms, stats=GenerationStats("deadline"), start_ms=start_ms))
        return ctx.draft

    async def generate_quietly(self, ctx: RunContext, stage: Stage, documents: Sequence[Document], draft: str = "") -> str:
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


def merge_documents(groups: Sequence[Sequence[Document]], limit: int) -> list[Document]:
    """Unique documents across several result lists, best score first."""
    best: dict[int, Document] = {}
    for group in groups:
        for doc in group:
            if doc.id not in best or doc.score > best[doc.id].score:
                best[doc.id] = doc
    return sorted(best.values(), key=lambda d: (-d.score, d.id))[:limit]
