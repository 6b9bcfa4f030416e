"""Every pipeline end to end with a scripted engine and a recording retriever."""

from __future__ import annotations

import asyncio
import functools
import time
from dataclasses import asdict

import pytest

from telerag.engines.errors import EngineError
from telerag.pipelines import prompts
from telerag.pipelines.rag.base import STANDALONE_QUESTION
from telerag.pipelines.registry import PIPELINES, build_pipelines
from telerag.pipelines.types import MeanQuery, RunOptions, StageEvent, StageRole, TokenEvent, Turn, event_stream, query_texts
from tests.fakes import RecordingRetriever, Reply, ScriptedEngine
from tests.scripted_pipelines import SURE, UNSURE, make, run, script


def streamed(events: list) -> str:
    return "".join(e.text for e in events if isinstance(e, TokenEvent))


def kinds(log: list) -> list[str]:
    return [k for k, _ in log]


async def test_naive_order_and_result():
    pipeline, _engine, _retriever, log = make("naive")
    result, events = await run(pipeline, top_k=2)
    assert kinds(log) == ["prefetch", "search", "release", "llm_start", "llm_end"]
    assert result.answer == "The Nile is long"
    assert streamed(events) == "The Nile is long"
    assert len(result.documents) == 2 and result.pipeline == "naive"
    assert [s.stage.name for s in result.steps] == ["prefetch", "search", "generate"]
    assert result.prefetch.overlap_rate == 0.75 and result.prefetch.clusters_device == 3
    assert {
        "total_ms",
        "embed_ms",
        "prefetch_ms",
        "pre_retrieval_ms",
        "search_ms",
        "search_device_ms",
        "search_cpu_ms",
        "llm_ms",
        "generate_ms",
    } == asdict(result.timings).keys()
    stages = [(e.stage.name, e.status) for e in events if isinstance(e, StageEvent)]
    assert stages[:2] == [("prefetch", "start"), ("prefetch", "end")]


async def test_hyde_prefetches_beside_the_pre_retrieval_call_and_searches_after_both():
    pipeline, _engine, retriever, log = make("hyde")
    await run(pipeline)
    order = kinds(log)
    assert sorted(order[:3]) == ["llm_end", "llm_start", "prefetch"]  # in whichever order the loop runs them
    assert order[3:] == ["search", "release", "llm_start", "llm_end"]
    assert retriever.prefetches == [["How long is the Nile?"]]  # q_in: what is known before the call
    # q_out: the mean of the question's and the hypothetical passage's embeddings
    assert retriever.searches == [[MeanQuery(("How long is the Nile?", "The Nile is a river in Africa"))]]


async def test_hyde_searches_with_the_question_when_the_passage_is_only_a_cue():
    pipeline, _engine, retriever, _log = make("hyde", passage="Passage:\nPassage:")
    await run(pipeline)
    assert retriever.searches == [["How long is the Nile?"]]


@pytest.mark.parametrize(
    "name",
    [
        n
        for n, cls in PIPELINES.items()
        if any(s.role is StageRole.PRE_RETRIEVAL and s is not STANDALONE_QUESTION for s in cls.stages)
    ],
)
async def test_the_pre_retrieval_call_never_waits_for_the_prefetch(name):
    """Embedding q_in, ranking and issuing copies run beside the LLM call: a prefetch that can
    only finish once an LLM call has started must not hold the pipeline up, and the trace shows
    the two overlapping."""
    llm_started = asyncio.Event()

    class Engine(ScriptedEngine):
        async def stream(self, prompts, params):
            llm_started.set()
            await asyncio.sleep(0.01)
            async for item in super().stream(prompts, params):
                yield item

    class Retriever(RecordingRetriever):
        async def prefetch(self, queries, *, enabled=True, overlap_ms=None):
            if overlap_ms != 0.0:  # a prefetch with a pre-retrieval call to hide behind
                await asyncio.wait_for(llm_started.wait(), timeout=10)  # times out if the LLM waits for us
            return await super().prefetch(queries, enabled=enabled, overlap_ms=overlap_ms)

    retriever = Retriever()
    pipeline = build_pipelines(Engine(script(decide="yes")), retriever, names=[name])[name]
    result, _ = await run(pipeline)
    prefetches = [s for s in result.steps if s.kind == "prefetch"]
    calls = [s for s in result.steps if s.kind == "llm"]
    assert any(p.start_ms <= c.start_ms + c.ms and c.start_ms <= p.start_ms + p.ms for p in prefetches for c in calls)
    assert not retriever.outstanding


async def test_subquestion_searches_the_question_and_its_sub_questions_in_one_batch():
    pipeline, _engine, retriever, log = make("subquestion")
    result, _ = await run(pipeline, top_k=3)
    assert retriever.searches == [
        ["How long is the Nile?", "Where is the Nile", "How long is the Nile", "Which seas does it reach"]
    ]
    assert kinds(log).count("search") == 1 and len(result.documents) == 3


async def test_subquestion_drops_repeated_sub_questions():
    sub = "Where is the Nile?\nwhere is  the NILE?\nHow long is the Nile?\nWhere is the Nile?"
    pipeline, _engine, retriever, _log = make("subquestion", sub_questions=sub)
    await run(pipeline)
    assert retriever.searches == [["How long is the Nile?", "Where is the Nile?"]]


async def test_iterative_searches_with_the_question_beside_its_narrower_question():
    pipeline, _engine, retriever, _log = make("iterative", judge="no")
    await run(pipeline)
    assert retriever.searches == [[MeanQuery(("How long is the Nile?", "Nile length"))]] * 3
    assert retriever.prefetches[0] == ["How long is the Nile?"]


async def test_iterative_stops_on_a_positive_judgement():
    pipeline, _, retriever, _ = make("iterative", judge="yes")
    await run(pipeline)
    assert len(retriever.searches) == 1
    pipeline, _engine, retriever, _log = make("iterative", judge="no")
    await run(pipeline)
    assert len(retriever.searches) == 3  # MAX_ITERATIONS


async def test_iter_retgen_runs_three_rounds_and_feeds_answers_forward():
    pipeline, _engine, retriever, log = make("iter_retgen")
    await run(pipeline)
    assert len(retriever.searches) == 3
    assert retriever.searches[1] == ["How long is the Nile? The Nile is long"]
    # each later round's prefetch runs beside that round's generation (its pre-retrieval call)
    order = kinds(log)
    assert order[:3] == ["prefetch", "search", "release"]
    assert sorted(order[3:6]) == ["llm_end", "llm_start", "prefetch"] and order[6:8] == ["search", "release"]


async def test_flare_retrieves_exactly_on_low_probability_tokens():
    # sentence 1: every token sure -> no retrieval; sentence 2: one unsure token -> retrieval
    pipeline, _engine, retriever, _log = make(
        "flare", flare_logprobs=[(SURE,) * 4, (SURE, SURE, UNSURE, SURE), (SURE,) * 4, (SURE,) * 4, (SURE,) * 4]
    )
    result, _ = await run(pipeline, max_tokens=10)
    assert len(retriever.searches) == 1
    assert retriever.searches[0] == ["How long is the Nile? The Nile north"]  # "flows" (p=0.1) masked
    assert len(retriever.prefetches) == len([s for s in result.steps if s.stage.name == "lookahead_sentence"])
    assert all(t.queries for t in retriever.released)


async def test_flare_never_retrieves_when_all_tokens_are_sure():
    pipeline, _engine, retriever, _log = make("flare", flare_logprobs=[(SURE,) * 4] * 6)
    await run(pipeline, max_tokens=8)
    assert retriever.searches == []
    assert len(retriever.released) == len(retriever.prefetches) > 0


@pytest.mark.parametrize(("decide", "searches"), [("yes", 1), ("no", 0), ("No.", 0), ("Jupiter", 1), ("nothing", 1)])
async def test_self_rag_decides_whether_to_retrieve(decide, searches):
    pipeline, _engine, retriever, _log = make("self_rag", decide=decide)
    result, _ = await run(pipeline)
    assert len(retriever.searches) == searches
    assert len(retriever.released) == 1 and not retriever.outstanding
    assert result.answer


async def test_self_rag_revises_an_unsupported_answer():
    pipeline, engine, _retriever, _log = make("self_rag", critique="no")
    _result, _events = await run(pipeline)
    assert any(p.startswith("You answer questions") and "Rewrite the answer" in p for p in engine.prompts)


@pytest.mark.parametrize("name", list(PIPELINES))
async def test_engine_errors_reach_the_caller_typed_and_release(name):
    log: list = []
    retriever = RecordingRetriever(log)
    pipeline = build_pipelines(ScriptedEngine(script(), log, fail=True), retriever, names=[name])[name]
    with pytest.raises(EngineError):
        await run(pipeline)
    assert not retriever.outstanding


@pytest.mark.parametrize("name", list(PIPELINES))
async def test_cancellation_releases_the_prefetch(name):
    log: list = []
    retriever = RecordingRetriever(log)
    pipeline = build_pipelines(ScriptedEngine(script(), log, delay=10.0), retriever, names=[name])[name]
    stream = event_stream(functools.partial(pipeline.run, "How long is the Nile?", RunOptions()))
    first = await stream.__anext__()
    assert isinstance(first, StageEvent)
    await asyncio.sleep(0.05)
    await stream.aclose()  # the client went away
    assert retriever.prefetches and not retriever.outstanding
    assert kinds(log)[-1] in ("release", "llm_end")


@pytest.mark.parametrize("name", list(PIPELINES))
async def test_a_run_past_its_deadline_sends_nothing_to_the_engine_and_says_so(name):
    """A request whose deadline came while it waited for its slot: every LLM call is skipped
    (the engine would stop it before its first token), the searches still release what they pinned."""
    pipeline, engine, retriever, _log = make(name, decide="yes", critique="no")
    result, events = await run(pipeline, deadline=time.monotonic() - 1.0)
    assert engine.prompts == []
    assert result.finish_reason == "deadline" and result.answer == streamed(events) == ""
    llm_steps = [s for s in result.steps if s.kind == "llm"]
    assert llm_steps and all(s.stopped_at_deadline and s.tokens_out == 0 for s in llm_steps)
    assert not retriever.outstanding


@pytest.mark.parametrize(("name", "stalled"), [("self_rag", "Is the answer supported"), ("iterative", "Does the answer fully")])
async def test_a_deadline_that_comes_after_a_draft_answers_with_the_draft(name, stalled):
    """The call after the draft runs until the deadline stops it; the answer's call, begun past
    it, would write nothing, so the draft is the answer, streamed, and the result says why."""
    replies = script(decide="yes", critique="no", judge="no")

    def reply(prompt: str) -> Reply:
        return Reply("maybe", token_delay=60.0) if stalled in prompt else replies(prompt)

    log: list = []
    engine, retriever = ScriptedEngine(reply, log), RecordingRetriever(log)
    pipeline = build_pipelines(engine, retriever, names=[name])[name]
    result, events = await run(pipeline, deadline=time.monotonic() + 0.5)
    assert result.answer == streamed(events) == "The Nile is long"
    assert result.finish_reason == "deadline"
    assert stalled in engine.prompts[-1]  # nothing was sent to the engine after the stalled call
    assert [s.stage.role for s in result.steps if s.stopped_at_deadline][-1] is StageRole.GENERATE
    assert not retriever.outstanding


async def test_an_answer_the_deadline_stops_is_what_was_streamed_by_then():
    full = " ".join(f"word{i}" for i in range(100_000))
    pipeline, engine, _retriever, _log = make("naive", answer=full)
    engine.token_delay = 0.001
    result, events = await run(pipeline, max_tokens=100_000, deadline=time.monotonic() + 0.5)
    assert result.finish_reason == "deadline"
    assert result.answer == streamed(events) and full.startswith(result.answer) and len(result.answer) < len(full)


def test_every_pipeline_declares_its_stages():
    for cls in PIPELINES.values():
        roles = {s.role for s in cls.stages}
        assert {StageRole.PREFETCH, StageRole.SEARCH, StageRole.GENERATE} <= roles
        assert len({s.name for s in cls.stages}) == len(cls.stages)  # a name is one stage
        assert cls.description
    # across pipelines too: one name, one role
    roles_of: dict[str, set[StageRole]] = {}
    for cls in PIPELINES.values():
        for s in cls.stages:
            roles_of.setdefault(s.name, set()).add(s.role)
    assert all(len(roles) == 1 for roles in roles_of.values()), roles_of


# Scripts that between them take every branch of every pipeline: FLARE retrieving and not,
# Iterative's judge saying yes and no, Self-RAG retrieving or not, its critique accepting or not.
BRANCHES = [
    ("naive", {}),
    ("hyde", {}),
    ("subquestion", {}),
    ("iter_retgen", {}),
    ("iterative", {"judge": "yes"}),
    ("iterative", {"judge": "no"}),
    ("flare", {"flare_logprobs": [(SURE,) * 4, (SURE, SURE, UNSURE, SURE)] * 3}),
    ("flare", {"flare_logprobs": [(SURE,) * 4] * 6}),
    ("self_rag", {"critique": "yes"}),
    ("self_rag", {"critique": "no"}),
    ("self_rag", {"decide": "no"}),
]


class VirtualClock:
    """Seconds that pass only when the fakes say their work took them: so a run's total is
    exactly what its stages took plus what passed outside any stage (here nothing)."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def timed_fakes(clock: VirtualClock, **script_args):
    """A scripted engine and a recording retriever whose calls advance `clock`: each LLM call
    20 ms (plus 1 ms per token streamed), a prefetch 3 ms, a search 7 ms."""

    class Engine(ScriptedEngine):
        async def stream(self, prompts, params):
            clock.now += 0.020
            async for item in super().stream(prompts, params):
                clock.now += 0.001
                yield item

    class Retriever(RecordingRetriever):
        async def prefetch(self, queries, *, enabled=True, overlap_ms=None):
            clock.now += 0.003
            return await super().prefetch(queries, enabled=enabled, overlap_ms=overlap_ms)

        async def search(self, queries, options, ticket=None):
            clock.now += 0.007
            return await super().search(queries, options, ticket)

    return Engine(script(**script_args)), Retriever()


def covered_ms(steps) -> float:
    """The time covered by the steps' spans (overlapping spans counted once)."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted((s.start_ms, s.start_ms + s.ms) for s in steps):
        total += max(0.0, stop - max(start, end))
        end = max(end, stop)
    return total


@pytest.mark.parametrize(("name", "script_args"), BRANCHES, ids=lambda v: v if isinstance(v, str) else ",".join(v) or "-")
async def test_a_run_traces_only_declared_stages_and_its_timings_add_up(name, script_args):
    """Every stage a run emits (events and steps) is one its pipeline declares; each timing is
    the sum of its role's steps; and the steps' spans cover the run's whole total, since on this
    clock no time passes outside a stage (a call left untraced would show as a gap)."""
    clock = VirtualClock()
    engine, retriever = timed_fakes(clock, **script_args)
    pipeline = build_pipelines(engine, retriever, names=[name])[name]
    pipeline.clock = clock
    result, events = await run(pipeline, max_tokens=12)
    declared = set(type(pipeline).stages)
    assert {e.stage for e in events if isinstance(e, StageEvent)} <= declared
    assert {s.stage for s in result.steps} <= declared
    t = result.timings
    by_role = {role: sum(s.ms for s in result.steps if s.stage.role is role) for role in StageRole}
    assert (t.prefetch_ms, t.pre_retrieval_ms, t.search_ms, t.llm_ms, t.generate_ms) == pytest.approx(
        (
            by_role[StageRole.PREFETCH],
            by_role[StageRole.PRE_RETRIEVAL],
            by_role[StageRole.SEARCH],
            by_role[StageRole.LLM],
            by_role[StageRole.GENERATE],
        )
    )
    assert t.total_ms > 0 and covered_ms(result.steps) == pytest.approx(t.total_ms)
    assert all(s.start_ms >= 0 and s.start_ms + s.ms <= t.total_ms + 1e-9 for s in result.steps)
    if name != "flare":  # FLARE's kept sentences are its look-ahead's; every other answer is written by a generate stage
        assert t.generate_ms > 0


async def test_a_stage_a_pipeline_does_not_declare_is_refused():
    from telerag.pipelines.errors import UndeclaredStage
    from telerag.pipelines.types import Stage

    pipeline, _engine, _retriever, _log = make("naive")

    async def body(ctx):
        return await pipeline.reply(ctx, Stage("improvised", StageRole.LLM), prompts.judge(ctx.query, "x"))

    pipeline.body = body
    with pytest.raises(UndeclaredStage, match="improvised"):
        await run(pipeline)


async def test_flare_counts_rewritten_sentences_as_answer_generation():
    """A sentence written again after a retrieval is answer text: `generate`, not pre-retrieval."""
    clock = VirtualClock()
    engine, retriever = timed_fakes(clock, flare_logprobs=[(SURE, SURE, UNSURE, SURE)] * 8)
    pipeline = build_pipelines(engine, retriever, names=["flare"])["flare"]
    pipeline.clock = clock
    result, _ = await run(pipeline, max_tokens=12)
    assert retriever.searches and result.timings.generate_ms > 0
    assert {s.stage.name for s in result.steps if s.stage.role is StageRole.GENERATE} == {"sentence"}


async def test_every_pipeline_runs_on_the_tiny_model():
    from tests.tiny_models import tiny_engine

    engine = tiny_engine()
    retriever = RecordingRetriever()
    for name, pipeline in build_pipelines(engine, retriever).items():
        result, events = await run(pipeline, max_tokens=8)
        assert result.pipeline == name
        assert streamed(events) == result.answer, name  # real tokenizer pieces, leading spaces and all
        assert result.steps and result.timings.total_ms > 0
        assert not retriever.outstanding


async def test_every_pipeline_on_the_tiny_model_and_a_small_datastore(tmp_path):
    """The real retriever (cache, prefetch, cooperative search) under every pipeline, greedy."""
    from telerag.pipelines.datastores import open_retriever
    from tests.retrieval_helpers import topic_datastore
    from tests.tiny_models import tiny_engine

    embedder, path = topic_datastore(tmp_path, per_topic=40, nlist=4)
    retriever = open_retriever(path, embedder, device="cpu", cache_bytes=1 << 20, prefetch_budget_bytes=1 << 20)
    engine = tiny_engine()
    try:
        for name, pipeline in build_pipelines(engine, retriever).items():
            first, _ = await run(pipeline, "river water fish", max_tokens=6, top_k=2)
            again, _ = await run(pipeline, "river water fish", max_tokens=6, top_k=2)
            assert first.answer == again.answer, name  # greedy: deterministic
            assert [d.id for d in first.documents] == [d.id for d in again.documents]
            searches = [s for s in first.steps if s.kind == "retrieval"]
            if searches:
                assert all(s.stats.clusters_device + s.stats.clusters_cpu > 0 for s in searches)
                assert first.prefetch.overlap_rate is not None
            assert retriever.cache_stats().pinned_clusters == 0
    finally:
        retriever.close()


async def test_prefetch_budget_follows_the_pre_retrieval_time():
    """HyDE's prefetch asks for its expected pre-retrieval time (t_LLM), starting from the
    profile and then a moving average of its own calls; naive, with none, asks for nothing."""
    log: list = []
    engine = ScriptedEngine(script(), log, delay=0.05)
    retriever = RecordingRetriever(log)
    pipelines = build_pipelines(engine, retriever, names=["hyde", "naive"], pre_retrieval_ms={"hyde": 1000.0})
    await run(pipelines["hyde"])
    assert retriever.overlaps_ms == [1000.0]
    observed = pipelines["hyde"].pre_retrieval_ms
    assert 800.0 < observed < 1000.0  # a fifth of the way to the ~50 ms call
    await run(pipelines["hyde"])
    assert retriever.overlaps_ms[-1] == observed
    await run(pipelines["naive"])
    assert retriever.overlaps_ms[-1] == 0.0


@pytest.mark.parametrize("name", list(PIPELINES))
async def test_the_streamed_text_is_the_answer(name):
    """What a client is streamed, concatenated, is exactly `RagResult.answer`: no leading space
    (the fake's tokens are words followed by a space, as a real tokenizer's pieces often lead
    with one), no trailing one."""
    pipeline, _engine, _retriever, _log = make(name, decide="yes", critique="no", answer=" Answer: The Nile is long ")
    result, events = await run(pipeline)
    assert result.answer and streamed(events) == result.answer
    assert result.answer == result.answer.strip() and "Answer:" not in result.answer


@pytest.mark.parametrize(
    ("generated", "answer"),
    [
        ("Answer:\nAnswer:\nAnswer:\nAnswer:", ""),  # a model looping on the cue
        ("Answer: The Nile is long Answer: The Nile is long Answer:", "The Nile is long"),  # looping on one line
        ("The Nile is long\nAnswer: The Nile", "The Nile is long"),
    ],
)
async def test_a_repeated_answer_cue_is_cut_and_ends_the_generation(generated, answer):
    pipeline, engine, _retriever, _log = make("naive", answer=generated)
    chunks = []

    async def recording_stream(prompts, params):
        async for item in ScriptedEngine.stream(engine, prompts, params):
            chunks.append(item)
            yield item

    engine.stream = recording_stream
    result, events = await run(pipeline, max_tokens=64)
    assert result.answer == answer and streamed(events) == answer
    # the generation stops at the repeated cue: the rest is never asked of the engine
    assert len(chunks) <= len(generated.split("Answer:")[0].split()) + len(answer.split()) + 2


async def test_the_answer_prompt_keeps_a_stable_prefix_and_stops_at_the_cue():
    """System text and instruction first, then the documents, then the question, so a prefix
    cache hits across requests; the engine is told to stop at the cue on a new line."""
    pipeline, engine, _retriever, _log = make("naive")
    seen = []
    original = engine.stream

    def stream(prompts, params):
        seen.append((prompts[0], params.stop))
        return original(prompts, params)

    engine.stream = stream
    await run(pipeline, query="How long is the Nile?")
    await run(pipeline, query="Where does the Amazon flow?")
    (first, stops), (second, _) = seen
    assert first.startswith(prompts.SYSTEM + "\n\nDocuments:\n") and second.startswith(prompts.SYSTEM + "\n\nDocuments:\n")
    assert first.index("Documents:") < first.index("Question: How long is the Nile?") < first.index("\nAnswer:")
    assert first.endswith("\nAnswer:") and "\nAnswer:" in stops


FOLLOW_UP = (Turn("user", "Tell me about the Nile."), Turn("assistant", "It is a river in Africa."))


@pytest.mark.parametrize("name", list(PIPELINES))
async def test_a_follow_up_is_rewritten_to_stand_alone_beside_the_prefetch_of_the_message_as_asked(name):
    """With a conversation, the last message is rewritten first (a pre-retrieval call), its own
    clusters prefetched beside the call; the pipeline then runs on the standalone question."""
    pipeline, engine, retriever, _log = make(name)
    result, _ = await run(pipeline, query="How long is it?", history=FOLLOW_UP)
    prefetch, rewrite = result.steps[0], result.steps[1]  # in the order they started
    assert rewrite.stage is STANDALONE_QUESTION and prefetch.kind == "prefetch"
    assert prefetch.start_ms <= rewrite.start_ms + rewrite.ms and rewrite.start_ms <= prefetch.start_ms + prefetch.ms
    assert engine.prompts[0].endswith("User: Tell me about the Nile.\nAssistant: It is a river in Africa.\nTopic:")
    assert retriever.prefetches[0] == ["How long is it?"]  # q_in: the message as asked
    searched = [text for search in retriever.searches for query in search for text in query_texts(query)]
    assert "How long is it?" not in searched  # never the message as asked (FLARE, sure of every token, never searches)
    answering = [p for p in engine.prompts if p.rstrip().endswith("Answer:")]
    assert answering and all("Question: How long is it? (the Nile)" in p for p in answering)
    assert not retriever.outstanding


async def test_without_a_pre_retrieval_call_of_its_own_the_first_search_uses_the_rewrites_prefetch():
    """Naive's search of the standalone question waits on the prefetch that ran beside the
    rewrite (its overlap rate is the rewrite's q_in/q_out overlap); HyDE prefetches anew."""
    naive, _engine, retriever, _log = make("naive")
    result, _ = await run(naive, query="How long is it?", history=FOLLOW_UP)
    assert retriever.prefetches == [["How long is it?"]] and retriever.searches == [["How long is it? (the Nile)"]]
    assert [s.stage.name for s in result.steps] == ["prefetch", "standalone_question", "search", "generate"]
    hyde, _engine, retriever, _log = make("hyde")
    await run(hyde, query="How long is it?", history=FOLLOW_UP)
    assert retriever.prefetches == [["How long is it?"], ["How long is it? (the Nile)"]]
    assert len(retriever.released) == 2 and not retriever.outstanding
