"""The models of OpenAI's Responses API, `POST /v1/responses` (`routes/responses.py`), as the
official SDK and LangChain (`use_responses_api=True`) send and read them.

As on the chat route, every field is served or refused: the request model forbids what it does
not list, and a value that asks for what the server lacks (an image part, a tool call item,
`store: true`, a JSON format) is refused with a 400 naming it. Nothing is stored, so a response
cannot be fetched again or continued by `previous_response_id` (refused by name too).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    Tag,
    create_model,
    field_validator,
    model_validator,
)

from telerag.config.settings import LimitSettings
from telerag.documents.ingestion import IngestionProgress
from telerag.file_search.store_retriever import StoresRetriever
from telerag.pipelines.types import RagResult
from telerag.server.protocols.common import (
    RetrievedPassageOut,
    default_max_tokens,
    discriminated_by,
    integer,
    passages_out,
    pipeline_name,
    question_text,
    refuse,
)
from telerag.server.protocols.conversation import Conversation, Said, content_text
from telerag.server.protocols.file_search import FileCitation, FileSearchCall, FileSearchTool, citations
from telerag.server.protocols.openai import answer_cut, text_only
from telerag.server.protocols.ops import ANSWERED_WHILE_INGESTING, IngestionInfo

FILE_SEARCH_RESULTS = "file_search_call.results"


class InputText(BaseModel):
    """A text part of an input message (`output_text`: an earlier answer given back as history)."""

    model_config = ConfigDict(strict=True, extra="forbid")

    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = Field(None, description="of an earlier answer's text; not read")

    _text_only = model_validator(mode="before")(text_only("input_text", "output_text"))


def messages_only(items: Any) -> Any:
    """Only messages are served as `input` items (no tool calls, tool outputs or references): any
    other is refused by name, before the items are told apart by role."""
    if isinstance(items, list):
        for at, item in enumerate(items):
            if isinstance(item, dict) and isinstance(kind := item.get("type"), str) and kind != "message":
                raise refuse(f"only messages: item {at} is a {kind}")
    return items


def results_only(items: Any) -> Any:
    """Of what `include` may ask, only the file search's results are served: the rest is refused by name."""
    if isinstance(items, list):
        for item in items:
            if isinstance(item, str) and item != FILE_SEARCH_RESULTS:
                raise refuse(f'only "{FILE_SEARCH_RESULTS}": {item} is not served')
    return items


class InputMessage(BaseModel):
    """An item of `input`, a message."""

    model_config = ConfigDict(strict=True, extra="forbid")

    type: Literal["message"] | None = None
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputText]
    id: str | None = Field(None, description="of an earlier answer given back as history; not read")
    status: str | None = Field(None, description="of an earlier answer given back as history; not read")

    @property
    def text(self) -> str:
        return content_text(self.content)


class TextFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    type: Literal["text"]

    _text_only = model_validator(mode="before")(text_only("text"))


class TextConfig(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    format: TextFormat | None = None


class ResponseRequest(Conversation):
    """`POST /v1/responses`: the last user message of `input` (or `input` itself) is the
    question, `model` the pipeline, `instructions` and system messages instruct the answer.
    The bounded fields get their bounds per app (`response_request_model`)."""

    QUERY_FIELD: ClassVar[str] = "input"
    input: str | list[InputMessage]
    instructions: str | None = Field(None, description="instruct the answer, as a system message does")
    max_output_tokens: int | None = None
    stream: bool = Field(False, description="true: the Responses API's events as server-sent events")
    text: TextConfig | None = Field(None, description='only {"format": {"type": "text"}}')
    store: Literal[False] | None = Field(None, description="only false: nothing is stored")
    truncation: Literal["disabled"] | None = Field(None, description='only "disabled": an input too long is refused')
    metadata: dict[str, str] | None = Field(None, description="given back with the response")
    include: Annotated[list[Literal["file_search_call.results"]], BeforeValidator(results_only)] | None = Field(
        None, description='only "file_search_call.results": the passages in the file_search_call item'
    )

    @field_validator("store", mode="before")
    @classmethod
    def _nothing_stored(cls, value: Any) -> Any:
        if value is not None and not isinstance(value, bool):
            raise ValueError("store is a boolean")  # Literal[False] alone would take 0
        if value is True:
            raise refuse("only false: nothing is stored here, so a response cannot be fetched or continued")
        return value

    @field_validator("truncation", mode="before")
    @classmethod
    def _nothing_cut(cls, value: Any) -> Any:
        if isinstance(value, str) and value != "disabled":
            raise refuse('only "disabled": an input too long for the prompt is refused, never cut')
        return value

    @property
    def said(self) -> Sequence[Said]:
        return [InputMessage(role="user", content=self.input)] if isinstance(self.input, str) else self.input

    @property
    def token_limit(self) -> int | None:
        return self.max_output_tokens

    @property
    def preamble(self) -> str:
        return self.instructions or ""


def response_request_model(limits: LimitSettings, pipelines: Sequence[str]) -> type[ResponseRequest]:
    """`ResponseRequest` for one app: its limits and pipeline names become the fields' constraints
    (a user message's content, or each of its text parts, is a question as `input` alone is)."""
    question: Any = question_text(limits)
    max_tokens = default_max_tokens(limits)

    def has_question(items: list[InputMessage]) -> list[InputMessage]:
        if not any(item.role == "user" for item in items):
            raise ValueError("at least one user message is required")
        return items

    part: Any = create_model("UserInputText", __base__=InputText, __module__=__name__, text=(question, ...))
    parts: Any = Annotated[list[part], Field(min_length=1)]
    user_role: Any = Literal["user"]
    other_role: Any = Literal["system", "developer", "assistant"]
    user: Any = create_model(
        "UserInput",
        __base__=InputMessage,
        __module__=__name__,
        role=(user_role, ...),
        content=(question | parts, Field(description="a question: text, or text parts (each one as a question is)")),
    )
    other: Any = create_model("OtherInput", __base__=InputMessage, __module__=__name__, role=(other_role, ...))
    messages: Any = Annotated[
        list[
            Annotated[
                Annotated[user, Tag("user")] | Annotated[other, Tag("other")],
                discriminated_by("role", {"user": ("user",), "other": ("system", "developer", "assistant")}),
            ]
        ],
        Field(min_length=1, json_schema_extra={"contains": {"properties": {"role": {"const": "user"}}, "required": ["role"]}}),
        BeforeValidator(messages_only),
        AfterValidator(has_question),
    ]
    return create_model(
        "ResponseRequest",
        __base__=ResponseRequest,
        __module__=__name__,
        model=(pipeline_name(pipelines), Field(description="the pipeline that answers (one of GET /v1/models)")),
        input=(
            question | messages,
            Field(description="the question, or messages of which the last user one is the question"),
        ),
        max_output_tokens=(
            integer(1, limits.max_tokens) | None,
            Field(None, description=f"tokens of the answer, at most (default {max_tokens})"),
        ),
    )


# -- the response -------------------------------------------------------------------------------


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[FileCitation] = Field(default_factory=list)


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    status: Literal["in_progress", "completed", "incomplete"]
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


class TokenDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokenDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: TokenDetails = Field(default_factory=TokenDetails)
    output_tokens: int
    output_tokens_details: OutputTokenDetails = Field(default_factory=OutputTokenDetails)
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


@dataclass(frozen=True)
class FileSearchOutput:
    """What a response with a `file_search` tool says of it: its `file_search_call` item (the
    results with their files' `attributes`, when asked for) and its answer's citations."""

    call_id: str
    stores: StoresRetriever  # the request's: what it searched, and its files' attributes
    with_results: bool

    def call(self, result: RagResult) -> FileSearchCall:
        return FileSearchCall.of(
            self.call_id, result, self.stores.searched, self.stores.attributes, with_results=self.with_results
        )


class ResponseObject(BaseModel):
    """A response, as the Responses API returns it (and its stream's lifecycle events carry it)."""

    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    status: Literal["in_progress", "completed", "incomplete"]
    model: str
    output: list[FileSearchCall | OutputMessage]
    instructions: str | None
    max_output_tokens: int | None
    temperature: float
    top_p: float
    metadata: dict[str, str] = Field(default_factory=dict)
    incomplete_details: IncompleteDetails | None = None
    error: None = None
    usage: ResponseUsage | None = None
    parallel_tool_calls: bool = False
    tool_choice: Literal["none", "auto"] = "none"
    tools: list[FileSearchTool] = Field(default_factory=list)
    text: TextConfig = Field(default_factory=lambda: TextConfig(format=TextFormat(type="text")))
    store: bool = False
    truncation: Literal["disabled"] = "disabled"
    documents: list[RetrievedPassageOut] | None = Field(
        None, description="an extension: the passages the answer was written from ([] with return_documents false)"
    )
    ingestion: IngestionInfo | None = Field(None, description=f"an extension: {ANSWERED_WHILE_INGESTING}")

    @classmethod
    def begun(cls, body: ResponseRequest, *, response_id: str, ingestion: IngestionProgress | None) -> ResponseObject:
        """What the stream announces first: the request's settings, no output yet."""
        return cls(
            id=response_id,
            status="in_progress",
            model=body.model,
            output=[],
            instructions=body.instructions,
            max_output_tokens=body.max_output_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            metadata=body.metadata or {},
            tool_choice="auto" if body.tools else "none",
            tools=body.tools or [],
            ingestion=None if ingestion is None else IngestionInfo.of(ingestion),
        )

    def finished(
        self, result: RagResult, *, message_id: str, with_documents: bool, file_search: FileSearchOutput | None = None
    ) -> ResponseObject:
        """The same response, its answer in: incomplete when the token limit cut the answer; with
        a file search, its call first and the answer citing its files."""
        cut = answer_cut(result)
        status: Literal["completed", "incomplete"] = "incomplete" if cut else "completed"
        prompt = result.prompt_tokens
        cited = [] if file_search is None else citations(result.documents, result.answer)
        message = OutputMessage(id=message_id, status=status, content=[OutputText(text=result.answer, annotations=cited)])
        return self.model_copy(
            update={
                "status": status,
                "output": [message] if file_search is None else [file_search.call(result), message],
                "incomplete_details": IncompleteDetails(reason="max_output_tokens") if cut else None,
                "usage": ResponseUsage(
                    input_tokens=prompt,
                    input_tokens_details=TokenDetails(cached_tokens=result.cached_tokens),
                    output_tokens=result.tokens_generated,
                    total_tokens=prompt + result.tokens_generated,
                ),
                "documents": passages_out(result.documents) if with_documents else [],
            }
        )
