"""The OpenAPI schema tells the truth: the configured limits are in it, fields are as strict as
it says, and every status and media type a route answers with is documented with its body."""

from __future__ import annotations

import pytest

from telerag.server.protocols.common import NON_BLANK
from tests.fake_app import Harness

LIMITS = {"max_query_chars": 99, "max_top_k": 7, "max_tokens": 33}


async def schema_of(h: Harness) -> dict:
    async with h.client() as client:
        return (await client.get("/openapi.json")).json()


async def test_the_configured_limits_are_in_the_schema():
    h = Harness(limits=LIMITS)
    components = (await schema_of(h))["components"]["schemas"]
    query = components["QueryRequest"]["properties"]
    assert query["query"]["maxLength"] == 99 and query["query"]["minLength"] == 1 and query["query"]["pattern"] == NON_BLANK
    assert query["top_k"]["anyOf"][0] == {"type": "integer", "minimum": 1, "maximum": 7}
    assert query["nprobe"]["anyOf"][0] == {"type": "integer", "minimum": 1}  # past the datastore's nlist: all its lists
    assert query["max_tokens"]["maximum"] == 33 and query["max_tokens"]["default"] == 33
    assert query["pipeline"]["enum"] == list(h.app.state.service.pipelines)
    assert components["QueryRequest"]["additionalProperties"] is False
    chat = components["ChatCompletionRequest"]["properties"]
    assert chat["model"]["enum"] == list(h.app.state.service.pipelines)
    assert chat["max_tokens"]["anyOf"][0]["maximum"] == 33
    assert chat["messages"]["contains"]["properties"]["role"] == {"const": "user"}
    text, parts = components["UserMessage"]["properties"]["content"]["anyOf"]
    assert text["maxLength"] == 99 and parts["items"] == {"$ref": "#/components/schemas/UserTextPart"}
    assert components["UserTextPart"]["properties"]["text"]["maxLength"] == 99  # each part is held to a question's limits
    assert components["ChatCompletionRequest"]["additionalProperties"] is False  # tools, audio, ...: refused, not ignored
    assert chat["n"]["anyOf"][0] == {"const": 1, "type": "integer"}


@pytest.mark.parametrize(
    ("body", "field", "status"),
    [
        ({"top_k": 7}, None, 200),
        ({"top_k": 8}, "top_k", 422),
        ({"max_tokens": 33}, None, 200),
        ({"max_tokens": 34}, "max_tokens", 422),
        ({"query": "x" * 99}, None, 200),
        ({"query": "x" * 100}, "query", 422),
        ({"nprobe": 0}, "nprobe", 422),
    ],
)
async def test_the_limits_in_the_schema_are_the_ones_enforced(body, field, status):
    h = Harness(limits=LIMITS)
    async with h.client() as client:
        response = await client.post("/v1/rag/query", json={"query": "q?", **body})
    assert response.status_code == status, response.text
    if field:
        assert response.json()["error"]["field"] == field


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"prefetch": 0}, "prefetch"),
        ({"stream": "true"}, "stream"),
        ({"return_documents": 1}, "return_documents"),
        ({"top_k": "3"}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"top_k": True}, "top_k"),
        ({"max_tokens": "8"}, "max_tokens"),
        ({"temperature": "0.5"}, "temperature"),
    ],
)
async def test_booleans_and_numbers_are_strict(body, field):
    h = Harness()
    async with h.client() as client:
        response = await client.post("/v1/rag/query", json={"query": "q?", **body})
    assert response.status_code == 422, response.text
    assert response.json()["error"]["field"] == field


async def test_an_integral_number_is_an_integer_as_json_schema_says():
    h = Harness()
    async with h.client() as client:
        response = await client.post("/v1/rag/query", json={"query": "q?", "top_k": 2.0})
    assert response.status_code == 200 and len(response.json()["documents"]) == 2


@pytest.mark.parametrize(
    ("messages", "field"),
    [
        ([{"role": "system", "content": "be brief"}], "messages"),
        ([{"role": "user", "content": "   "}], "messages.0.content"),
        ([{"role": "robot", "content": "hi"}], "messages.0"),
    ],
)
async def test_a_chat_needs_a_question(messages, field):
    h = Harness()
    async with h.client() as client:
        response = await client.post("/v1/chat/completions", json={"model": "naive", "messages": messages})
    assert response.status_code == 422, response.text
    assert response.json()["error"]["field"] == field


async def test_422_is_documented_as_the_error_body_the_server_sends():
    schema = await schema_of(Harness())
    assert "HTTPValidationError" not in schema["components"]["schemas"]
    for path, operations in schema["paths"].items():
        for method, operation in operations.items():
            if "422" in operation["responses"]:
                assert operation["responses"]["422"]["content"]["application/json"]["schema"] == {
                    "$ref": "#/components/schemas/ErrorResponse"
                }, (method, path)
    error = schema["components"]["schemas"]["ErrorResponse"]
    assert error["required"] == ["error"]
    assert set(schema["components"]["schemas"]["ErrorDetail"]["required"]) == {"type", "message"}


@pytest.mark.parametrize("path", ["/v1/rag/query", "/v1/chat/completions", "/v1/responses"])
@pytest.mark.parametrize("api_key", [None, "k"])
async def test_generating_routes_document_every_answer(path, api_key):
    schema = await schema_of(Harness(server={"api_key": api_key}))
    responses = schema["paths"][path]["post"]["responses"]
    expected = {"200", "400", "413", "422", "429", "502", "503", "504"} | ({"401"} if api_key else set())
    if path != "/v1/rag/query":  # a file_search tool's store not found, or no stores served
        expected |= {"404", "501"}
    assert set(responses) == expected
    assert set(responses["200"]["content"]) == {"application/json", "text/event-stream"}
    for status in expected - {"200"}:
        assert responses[status]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/ErrorResponse"}
    for status in ("429", "503"):
        assert responses[status]["headers"]["Retry-After"]["required"] is True
    assert ("security" in schema["paths"][path]["post"]) == bool(api_key)


async def test_the_event_streams_are_described_event_by_event():
    schema = await schema_of(Harness())
    components = schema["components"]["schemas"]
    query = schema["paths"]["/v1/rag/query"]["post"]["responses"]["200"]["content"]["text/event-stream"]["schema"]
    events = {e["properties"]["event"]["const"]: e["properties"]["data"]["contentSchema"]["$ref"] for e in query["oneOf"]}
    assert events == {
        "ingestion": "#/components/schemas/IngestionInfo",
        "stage": "#/components/schemas/StageUpdate",
        "token": "#/components/schemas/TokenText",
        "result": "#/components/schemas/QueryResponse",
        "error": "#/components/schemas/ErrorDetail",
    }
    chat = schema["paths"]["/v1/chat/completions"]["post"]["responses"]["200"]["content"]["text/event-stream"]["schema"]
    data = chat["oneOf"][0]["properties"]["data"]["anyOf"]
    assert data[0] == {"const": "[DONE]"}
    assert data[1]["contentSchema"]["anyOf"][0] == {"$ref": "#/components/schemas/ChatCompletionChunk"}
    for name in ("StageUpdate", "TokenText", "ChatCompletionChunk", "ChatChunkChoice", "ChatDelta"):
        assert name in components  # every reference resolves


async def test_metrics_are_documented_as_text():
    schema = await schema_of(Harness())
    assert set(schema["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == {"text/plain"}


@pytest.mark.parametrize(("query", "status"), [("\u0085", 422), ("\ufeff", 422), (" \u3000\t", 422), ("\u0085x", 200)])
async def test_blank_means_the_same_to_the_server_and_to_json_schema(query, status):
    """U+0085 is white space to Rust's and Python's regexes but not to ECMA-262's `\\s` (JSON
    Schema's), U+FEFF the other way round: the server refuses exactly what its schema does."""
    h = Harness()
    async with h.client() as client:
        response = await client.post("/v1/rag/query", json={"query": query})
    assert response.status_code == status, response.text
