"""The server as OpenAI clients use it, driven through the official `openai` SDK and
`langchain-openai` in process. Every field a client sends is honoured or refused with a 400
naming it; the documents behind an answer come with it."""

from __future__ import annotations

import asyncio

import httpx
import numpy as np
import openai
import pytest
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
from langchain_openai import ChatOpenAI, OpenAIEmbeddings

from tests.fake_app import Harness, sdk
from tests.retrieval_helpers import HashEmbedder

QUESTION = [{"role": "user", "content": "Capital of France?"}]
ANSWER = "Paris is the capital of France"


async def test_text_parts_are_a_question_as_a_string_is():
    h = Harness()
    async with h.client() as http:
        parts = [{"type": "text", "text": "Capital"}, {"type": "text", "text": "of France?"}]
        completion = await sdk(http).chat.completions.create(model="naive", messages=[{"role": "user", "content": parts}])
    assert completion.choices[0].message.content == ANSWER
    assert "Question: Capital\nof France?" in h.engine.prompts[-1]


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"n": 2}, "n"),
        ({"logprobs": True}, "logprobs"),
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"frequency_penalty": -1.0}, "frequency_penalty"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools"),
        ({"tool_choice": "auto"}, "tool_choice"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"modalities": ["text", "audio"]}, "modalities"),
        ({"temperature": 0.7, "seed": 1}, "seed"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/a.png"}}]}]},
            "messages.0.content.0",
        ),
        ({"messages": [{"role": "assistant", "content": None, "tool_calls": []}, *QUESTION]}, "messages.0.tool_calls"),
    ],
)
async def test_what_the_server_does_not_do_is_refused_naming_the_field(fields, param):
    h = Harness()
    body = {"model": "naive", "messages": QUESTION, **fields}
    async with h.client() as http:
        with pytest.raises(openai.BadRequestError) as refused:
            await sdk(http).chat.completions.create(**body)
    assert refused.value.status_code == 400 and refused.value.type == "invalid_request_error"  # OpenAI's error shape
    assert refused.value.code == "unsupported_field" and refused.value.param == param
    assert refused.value.body["message"].startswith(f"{param}: ")
    assert not h.engine.prompts  # refused before anything ran


async def test_the_values_that_ask_for_nothing_missing_are_served():
    h = Harness()
    async with h.client() as http:
        completion = await sdk(http).chat.completions.create(
            model="naive",
            messages=QUESTION,
            n=1,
            logprobs=False,
            presence_penalty=0,
            frequency_penalty=0.0,
            response_format={"type": "text"},
            modalities=["text"],
            seed=7,
            user="user-1",
        )
    assert completion.choices[0].message.content == ANSWER


async def test_stop_ends_the_answer_and_top_p_reaches_every_call():
    h = Harness()
    async with h.client() as http:
        client = sdk(http)
        stopped = await client.chat.completions.create(model="naive", messages=QUESTION, stop=["capital"])
        assert stopped.choices[0].message.content == "Paris is the" and stopped.choices[0].finish_reason == "stop"
        stream = await client.chat.completions.create(model="naive", messages=QUESTION, stop="the", stream=True)
        assert "".join([c.choices[0].delta.content or "" async for c in stream]).strip() == "Paris is"
        await client.chat.completions.create(model="hyde", messages=QUESTION, temperature=0.5, top_p=0.9)
    assert [p.top_p for p in h.engine.params[-2:]] == [0.9, 0.9]  # the hypothetical passage's call and the answer's
    assert "the" not in h.engine.params[-2].stop  # a client's stop string ends the answer, not the pipeline's own calls


@pytest.mark.parametrize("pipeline", list(Harness().app.state.service.pipelines))
async def test_every_pipeline_ends_its_answer_at_a_stop_string(pipeline):
    h = Harness()
    async with h.client() as http:
        client = sdk(http)
        whole = await client.chat.completions.create(model=pipeline, messages=QUESTION)
        stopped = await client.chat.completions.create(model=pipeline, messages=QUESTION, stop=["capital", "Nile"])
        stream = await client.chat.completions.create(model=pipeline, messages=QUESTION, stop="capital", stream=True)
        streamed = "".join([c.choices[0].delta.content or "" async for c in stream])
    assert "capital" in whole.choices[0].message.content
    assert stopped.choices[0].message.content.strip() == streamed.strip() == "Paris is the"


@pytest.mark.parametrize("pipeline", list(Harness().app.state.service.pipelines))
async def test_system_messages_instruct_every_prompt_that_writes_the_answer(pipeline):
    h = Harness()
    messages = [{"role": "system", "content": "Reply in French."}, {"role": "developer", "content": "Be brief."}, *QUESTION]
    async with h.client() as http:
        await sdk(http).chat.completions.create(model=pipeline, messages=messages)
    answering = [p for p in h.engine.prompts if p.rstrip().endswith("Answer:")]
    assert answering and all("Instructions: Reply in French.\nBe brief.\nQuestion: Capital of France?" in p for p in answering)
    assert not any("French" in p for p in h.engine.prompts if p not in answering)  # the pipeline's own calls keep theirs


async def test_a_follow_up_is_rewritten_from_the_conversation_before_retrieval():
    """The conversation's earlier turns make the last message a standalone question (about
    the topic the scripted engine names with its one reply); the message as asked is what is
    prefetched beside the call, the standalone question what is searched."""
    h = Harness()
    conversation = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Tell me about Paris."},
        {"role": "assistant", "content": "Paris is the capital of France."},
        {"role": "user", "content": "What river runs through it?"},
    ]
    async with h.client() as http:
        await sdk(http).chat.completions.create(model="naive", messages=conversation)
        await sdk(http).responses.create(model="naive", input=conversation)
    rewrites = [p for p in h.engine.prompts if p.startswith("Name the topic of the conversation")]
    expected = "User: Tell me about Paris.\nAssistant: Paris is the capital of France.\nTopic:"
    assert len(rewrites) == 2 and all(p.endswith(expected) for p in rewrites)
    assert h.retriever.prefetches == [["What river runs through it?"]] * 2
    assert h.retriever.searches == [[f"What river runs through it? ({ANSWER})"]] * 2  # the topic: the engine's one reply


async def test_the_documents_come_with_the_answer_unless_turned_off():
    h = Harness()
    async with h.client() as http:
        client = sdk(http)
        completion = await client.chat.completions.create(model="naive", messages=QUESTION)
        documents = completion.model_extra["documents"]
        assert len(documents) == 3 and {"id", "doc_id", "title", "text", "score", "source"} == documents[0].keys()
        stream = await client.chat.completions.create(model="naive", messages=QUESTION, stream=True)
        chunks = [chunk async for chunk in stream]
        assert [c.model_extra.get("documents") for c in chunks[:-1]] == [None] * (len(chunks) - 1)
        assert chunks[-1].choices[0].finish_reason == "stop" and chunks[-1].model_extra["documents"] == documents
        without = await client.chat.completions.create(model="naive", messages=QUESTION, extra_body={"return_documents": False})
        assert without.model_extra["documents"] == [] and without.choices[0].message.content == ANSWER


async def test_a_stream_reports_its_usage_when_asked():
    h = Harness()
    async with h.client() as http:
        client = sdk(http)
        stream = await client.chat.completions.create(
            model="naive", messages=QUESTION, stream=True, stream_options={"include_usage": True}
        )
        chunks = [chunk async for chunk in stream]
        whole = await client.chat.completions.create(model="naive", messages=QUESTION)
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    assert all(c.usage is None for c in chunks[:-1])


async def test_an_unknown_field_of_the_rag_api_is_refused_as_well():
    h = Harness()
    async with h.client() as http:
        response = await http.post("/v1/rag/query", json={"query": "q?", "tools": []})
    assert response.status_code == 400
    assert response.json()["error"] == {  # the slug in type: this is not an OpenAI route
        "type": "unsupported_field",
        "code": "unsupported_field",
        "message": "tools: not supported by this server",
        "field": "tools",
        "param": "tools",
    }


def test_langchain_chat_model_streams_and_invokes_with_its_own_fields():
    """LangChain's ChatOpenAI sends max_completion_tokens, a system message, text parts and a
    conversation (whose follow-up is made to stand alone)."""
    h = Harness()
    transport = httpx.ASGITransport(app=h.app)

    async def run() -> None:
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            chat = ChatOpenAI(model="naive", base_url="http://test/v1", api_key="unused", http_async_client=http, max_retries=0)
            reply = await chat.ainvoke([SystemMessage("be brief"), HumanMessage("Capital of France?")])
            assert reply.content == ANSWER and reply.response_metadata["finish_reason"] == "stop"
            cut = await chat.bind(max_completion_tokens=2).ainvoke("Capital of France?")
            assert cut.content == "Paris is" and cut.response_metadata["finish_reason"] == "length"
            parts = await chat.ainvoke([HumanMessage(content=[{"type": "text", "text": "Capital of France?"}])])
            assert parts.content == ANSWER
            pieces = [chunk.content async for chunk in chat.astream("Capital of France?")]
            assert "".join(pieces).strip() == ANSWER
            history = [
                HumanMessage("Tell me about Paris."),
                AIMessage("Paris is the capital of France."),
                HumanMessage("What river runs through it?"),
            ]
            assert (await chat.ainvoke(history)).content == ANSWER
            topic = [p for p in h.engine.prompts if p.startswith("Name the topic of the conversation")]
            assert len(topic) == 1 and topic[0].endswith(
                "User: Tell me about Paris.\nAssistant: Paris is the capital of France.\nTopic:"
            )
            with pytest.raises(openai.BadRequestError, match="tools"):
                await chat.bind_tools([{"type": "function", "function": {"name": "f", "parameters": {}}}]).ainvoke("hi")

    asyncio.run(run())


async def test_embeddings_are_the_datastores_own():
    """`/v1/embeddings` embeds with the datastore's embedder (as the SDK asks: base64 unless told)."""
    h = Harness()
    texts = ["river water fish", "star planet orbit"]
    expected = HashEmbedder().encode(texts)
    async with h.client() as http:
        client = sdk(http)
        embedded = await client.embeddings.create(model="hash-32", input=texts)
        floats = await client.embeddings.create(model="hash-32", input=texts[0], encoding_format="float", dimensions=32)
        schema = (await http.get("/openapi.json")).json()["components"]["schemas"]["EmbeddingRequest"]["properties"]
    assert [d.index for d in embedded.data] == [0, 1] and embedded.model == "hash-32"
    np.testing.assert_allclose(np.array([d.embedding for d in embedded.data]), expected, rtol=1e-6)
    np.testing.assert_allclose(floats.data[0].embedding, expected[0], rtol=1e-6)
    assert embedded.usage.prompt_tokens == embedded.usage.total_tokens == 6
    assert schema["model"]["enum"] == ["hash-32"] and schema["dimensions"]["anyOf"][0]["enum"] == [32]


@pytest.mark.parametrize(
    ("fields", "error", "param"),
    [
        ({"model": "text-embedding-3-small"}, openai.UnprocessableEntityError, "model"),
        ({"dimensions": 16}, openai.BadRequestError, "dimensions"),
        ({"input": [[101, 2054]]}, openai.BadRequestError, "input"),  # token ids (LangChain's default)
        ({"input": ["a", ""]}, openai.UnprocessableEntityError, "input.1"),
        ({"input": ["a"] * 257}, openai.UnprocessableEntityError, "input"),
    ],
)
async def test_embeddings_refuse_what_they_cannot_serve(fields, error, param):
    h = Harness()
    async with h.client() as http:
        with pytest.raises(error) as refused:
            await sdk(http).embeddings.create(**{"model": "hash-32", "input": "a text", **fields})
    assert refused.value.param == param and refused.value.type == "invalid_request_error"


def test_langchain_embeddings_embed_documents_and_queries():
    h = Harness()

    async def run() -> None:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=h.app), base_url="http://test") as http:
            embeddings = OpenAIEmbeddings(
                model="hash-32",
                base_url="http://test/v1",
                api_key="unused",
                http_async_client=http,
                check_embedding_ctx_length=False,  # send text, not tiktoken's token ids
                max_retries=0,
            )
            documents = await embeddings.aembed_documents(["river water fish", "star planet orbit"])
            query = await embeddings.aembed_query("river water fish")
        np.testing.assert_allclose(documents[0], query, rtol=1e-6)
        np.testing.assert_allclose(documents, HashEmbedder().encode(["river water fish", "star planet orbit"]), rtol=1e-6)

    asyncio.run(run())
