"""Every pipeline on a scripted engine and a recording retriever: the engine's replies keyed on
the pipelines' prompts, one pipeline built over them, and a run collected to its result."""

from __future__ import annotations

import math

from telerag.pipelines.registry import build_pipelines
from telerag.pipelines.types import RagResult, RunOptions
from tests.fakes import RecordingRetriever, Reply, ScriptedEngine

SURE = math.log(0.9)
UNSURE = math.log(0.1)


def script(
    judge: str = "yes",
    decide: str = "yes",
    critique: str = "yes",
    flare_logprobs=None,
    passage: str = "The Nile is a river in Africa",
    sub_questions: str = "Where is the Nile\nHow long is the Nile\nWhich seas does it reach",
    answer: str = "The Nile is long",
    topic: str = "the Nile",
):
    """The engine's reply to each pipeline prompt: the arguments choose each judgement (and
    FLARE's log-probabilities, one tuple per call), so a test can steer a pipeline's path."""
    flare_calls = iter(flare_logprobs or [])

    def reply(prompt: str) -> Reply:
        if prompt.startswith("Name the topic of the conversation"):
            return Reply(topic)
        if prompt.startswith("Write a short encyclopedia passage"):
            return Reply(passage)
        if prompt.startswith("Break the question"):
            return Reply(sub_questions)
        if prompt.startswith("Write one short search question"):
            return Reply("Nile length")
        if prompt.startswith("Does the answer fully answer"):
            return Reply(judge)
        if prompt.startswith("Would looking up documents help"):
            return Reply(decide)
        if "Is the answer supported by the documents?" in prompt:  # after the documents, as the draft's prompt
            return Reply(critique)
        if "Answer so far:" in prompt or flare_logprobs is not None:
            logprobs = next(flare_calls, None)
            if logprobs is not None:
                return Reply("The Nile flows north", logprobs)
        return Reply(answer)

    return reply


async def run(pipeline, query: str = "How long is the Nile?", **options) -> tuple[RagResult, list]:
    """Run `pipeline` to its result; the result and every event it emitted on the way."""
    events: list = []
    result = await pipeline.run(query, RunOptions(**options), events.append)
    return result, events


def make(name: str, **script_args):
    """Pipeline `name` over a scripted engine and a recording retriever sharing one call log."""
    log: list = []
    engine = ScriptedEngine(script(**script_args), log)
    retriever = RecordingRetriever(log)
    return build_pipelines(engine, retriever, names=[name])[name], engine, retriever, log
