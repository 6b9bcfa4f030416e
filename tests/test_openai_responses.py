"""OpenAI's Responses API (`POST /v1/responses`, the SDK's primary API) through the
official `openai` SDK and LangChain's `use_responses_api`, in process."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
from langchain_core.messages import HumanMessage, SystemMessage
from langchain_openai import ChatOpenAI

from tests.fake_app import Harness, sdk

ANSWER = "Paris is the capital of France"


async def test_a_response_answers_text_input_with_its_usage_and_documents():
    h = Harness()
    async with h.client() as http:
        response = await sdk(http).responses.create(
            model="hyde", input="Capital of France?", instructions="Be brief.", metadata={"ticket": "7"}
        )
    assert response.output_text == ANSWER and response.status == "completed" and response.id.startswith("resp_")
    assert response.usage.output_tokens > 0 and response.usage.total_tokens > response.usage.output_tokens
    assert response.instructions == "Be brief." and response.metadata == {"ticket": "7"}
    assert len(response.model_extra["documents"]) == 3
    answering = [p for p in h.engine.prompts if p.rstrip().endswith("Answer:")]
    assert "Instructions: Be brief.\nQuestion: Capital of France?" in answering[-1]


async def test_messages_and_parts_as_input_and_the_limit_makes_it_incomplete():
    h = Harness()
    conversation = [
        {"role": "system", "content": "Reply in French."},
        {"role": "user", "content": "Hello"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hi!", "annotations": []}]},
        {"role": "user", "content": [{"type": "input_text", "text": "Capital of France?"}]},
    ]
    async with h.client() as http:
        cut = await sdk(http).responses.create(model="naive", input=conversation, max_output_tokens=3)
    assert cut.output_text == "Paris is the" and cut.status == "incomplete"
    assert cut.incomplete_details.reason == "max_output_tokens"
    assert h.engine.prompts[0].endswith("User: Hello\nAssistant: Hi!\nTopic:")  # a follow-up: made to stand alone
    assert f"Instructions: Reply in French.\nQuestion: Capital of France? ({ANSWER})" in h.engine.prompts[-1]


async def test_the_stream_is_the_responses_apis_events_in_order():
    h = Harness()
    async with h.client() as http:
        stream = await sdk(http).responses.create(model="naive", input="Capital of France?", stream=True)
        events = [event async for event in stream]
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta").strip() == ANSWER
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].response.output_text == ANSWER and events[-1].response.usage.output_tokens > 0


async def test_a_failure_after_the_stream_began_is_an_error_event():
    h = Harness()
    h.engine.fail = True
    async with h.client() as http:
        stream = await sdk(http).responses.create(model="naive", input="Capital of France?", stream=True)
        events = [event async for event in stream]
    assert events[-1].type == "error" and events[-1].code == "engine_error" and events[-1].message


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tools": [{"type": "function", "name": "f", "parameters": {}}]}, "tools"),
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"store": True}, "store"),
        ({"text": {"format": {"type": "json_object"}}}, "text.format"),
        ({"input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]}, "input"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/a.png"}]}]},
            "input.0.content.0",
        ),
    ],
)
async def test_what_the_server_does_not_do_is_refused_naming_the_field(fields, param):
    h = Harness()
    async with h.client() as http:
        with pytest.raises(openai.BadRequestError) as refused:
            await sdk(http).responses.create(**{"model": "naive", "input": "Capital of France?", **fields})
    assert refused.value.type == "invalid_request_error" and refused.value.code == "unsupported_field"
    assert refused.value.param == param
    assert not h.engine.prompts


async def test_an_input_without_a_question_is_422_naming_input():
    h = Harness()
    async with h.client() as http:
        with pytest.raises(openai.UnprocessableEntityError) as refused:
            await sdk(http).responses.create(model="naive", input=[{"role": "system", "content": "Be brief."}])
    assert refused.value.param == "input"


def test_langchain_with_the_responses_api():
    h = Harness()

    async def run() -> None:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=h.app), base_url="http://test") as http:
            chat = ChatOpenAI(
                model="naive", base_url="http://test/v1", api_key="unused", http_async_client=http, use_responses_api=True
            )
            reply = await chat.ainvoke([SystemMessage("Be brief."), HumanMessage("Capital of France?")])
            assert reply.text == ANSWER
            pieces = [chunk.text async for chunk in chat.astream("Capital of France?")]
            assert "".join(pieces).strip() == ANSWER

    asyncio.run(run())
