"""The request and response models of the OpenAI-compatible routes (`routes/openai.py`), as
the official SDK and LangChain send and read them.

Every field a client may send is served or refused: the request model forbids what it does not
list, and a listed field that is served at some values only (`n: 1`, a text part) refuses the
others with a pydantic error of type `UNSUPPORTED`, which the app answers with a 400 naming it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    Tag,
    ValidationInfo,
    create_model,
    field_serializer,
    field_validator,
    model_validator,
)

from telerag.config.settings import LimitSettings
from telerag.documents.ingestion import IngestionProgress
from telerag.pipelines.types import RagResult
from telerag.server.protocols.common import (
    INTEGRAL,
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
from telerag.server.protocols.ops import ANSWERED_WHILE_INGESTING, IngestionInfo

SERVED_ONLY: dict[str, tuple[tuple[Any, ...], str]] = {  # OpenAI fields served at these values only (null: the same)
    "n": ((1,), "only 1: one choice per request"),
    "logprobs": ((False,), "only false: token log-probabilities are not returned"),
    "top_logprobs": ((0,), "only 0: token log-probabilities are not returned"),
    "presence_penalty": ((0, 0.0), "only 0: the engines apply no penalties"),
    "frequency_penalty": ((0, 0.0), "only 0: the engines apply no penalties"),
}


def text_only(*kinds: str) -> Callable[[Any, Any], Any]:
    """A before-validator of a typed part or format: a `type` other than `kinds` (an image, a
    JSON format) is refused by name."""

    def check(cls: Any, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(kind := data.get("type"), str) and kind not in kinds:
            raise refuse(f"only {' or '.join(kinds)}: {kind} is not served (text in, text out)")
        return data

    return check


class TextPart(BaseModel):
    """A piece of a message's content, as LangChain, LlamaIndex and Open WebUI send it. Only text
    is served: an image, audio or file part is refused by name."""

    model_config = ConfigDict(strict=True, extra="forbid")

    type: Literal["text"]
    text: str

    _text_only = model_validator(mode="before")(text_only("text"))


class ChatMessage(BaseModel):
    """A turn of the conversation; its content is a string or a list of text parts."""

    model_config = ConfigDict(strict=True, extra="forbid")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = Field(None, description="the speaker's name, as OpenAI takes it")

    @property
    def text(self) -> str:
        return content_text(self.content)


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    include_usage: bool = Field(False, description="true: a last chunk, before [DONE], with usage and no choices")


class ResponseFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    type: Literal["text"]

    _text_only = model_validator(mode="before")(text_only("text"))


def _text_modality(modalities: Any) -> Any:
    if isinstance(modalities, list) and any(m != "text" for m in modalities):
        raise refuse('only ["text"]: the answer is text')
    return modalities


class ChatCompletionRequest(Conversation):
    """`POST /v1/chat/completions`: the last user message is the question, `model` the pipeline.
    Every field OpenAI clients send is served or refused: a field not listed here (tool_choice,
    audio, ...), a tool other than file_search (`Conversation.tools`, an extension here) or a
    value marked "only" otherwise is refused with a 400 that names it, never ignored. The
    bounded fields get their bounds per app (`chat_request_model`)."""

    model_config = ConfigDict(
        strict=True,
        extra="forbid",
        json_schema_extra={  # seed is refused when sampling (`_seed_needs_greedy`): the schema says so
            "if": {"properties": {"temperature": {"exclusiveMinimum": 0}}, "required": ["temperature"]},
            "then": {"properties": {"seed": {"type": "null"}}},
        },
    )

    QUERY_FIELD: ClassVar[str] = "messages"
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    stop: str | Annotated[list[str], Field(max_length=4)] | None = Field(
        None, description="up to 4 strings: the answer ends before the first of them"
    )
    seed: Annotated[int, INTEGRAL] | None = Field(
        None, description="accepted at temperature 0 (greedy decoding: nothing to seed); refused when sampling"
    )
    stream: bool = Field(False, description="true: chat.completion.chunk objects as server-sent events")
    stream_options: StreamOptions | None = None
    n: Literal[1] | None = Field(None, description=SERVED_ONLY["n"][1])
    logprobs: Literal[False] | None = Field(None, description=SERVED_ONLY["logprobs"][1])
    top_logprobs: Literal[0] | None = Field(None, description=SERVED_ONLY["top_logprobs"][1])
    presence_penalty: float | None = Field(None, ge=0, le=0, description=SERVED_ONLY["presence_penalty"][1])
    frequency_penalty: float | None = Field(None, ge=0, le=0, description=SERVED_ONLY["frequency_penalty"][1])
    response_format: ResponseFormat | None = None
    modalities: Annotated[list[Literal["text"]], BeforeValidator(_text_modality)] | None = Field(
        None, description='only ["text"]: the answer is text'
    )

    @field_validator("messages")
    @classmethod
    def _has_question(cls, messages: list[ChatMessage]) -> list[ChatMessage]:
        if not any(m.role == "user" for m in messages):
            raise ValueError("at least one user message is required")
        return messages

    @field_validator(*SERVED_ONLY, mode="before")
    @classmethod
    def _served_values_only(cls, value: Any, info: ValidationInfo) -> Any:
        """Refused with a 400 naming the field (not a 422: the value is valid OpenAI, just not served here)."""
        allowed, why = SERVED_ONLY[str(info.field_name)]
        if value is not None and not any(type(value) is type(a) and value == a for a in allowed):
            raise refuse(why)
        return value

    @field_validator("seed")
    @classmethod
    def _seed_needs_greedy(cls, seed: int | None, info: ValidationInfo) -> int | None:
        if seed is not None and info.data.get("temperature", 0.0) > 0:
            raise refuse("only at temperature 0: sampling with a seed is not supported (temperature 0 decodes greedily)")
        return seed

    @property
    def said(self) -> Sequence[Said]:
        return self.messages

    @property
    def token_limit(self) -> int | None:
        """With both limits, the tighter, which honours both."""
        return min((n for n in (self.max_completion_tokens, self.max_tokens) if n is not None), default=None)

    @property
    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())


def chat_request_model(limits: LimitSettings, pipelines: Sequence[str]) -> type[ChatCompletionRequest]:
    """`ChatCompletionRequest` for one app: its limits and pipeline names become the fields'
    constraints, and so appear in the OpenAPI schema."""
    # The fields' types are made here, at run time, from the limits: values to pydantic, not types to mypy.
    pipeline = pipeline_name(pipelines)
    question = question_text(limits)
    user_role: Any = Literal["user"]
    other_role: Any = Literal["system", "developer", "assistant", "tool"]
    max_tokens = default_max_tokens(limits)
    part: Any = create_model("UserTextPart", __base__=TextPart, __module__=__name__, text=(question, ...))
    parts: Any = Annotated[list[part], Field(min_length=1)]

    user: Any = create_model(
        "UserMessage",
        __base__=ChatMessage,
        __module__=__name__,
        role=(user_role, ...),
        content=(
            question | parts,
            Field(
                description="a question (the last one is answered): text, or text parts (each at most "
                f"{limits.max_query_chars} characters, not blank)"
            ),
        ),
    )
    other: Any = create_model(
        "OtherMessage",
        __base__=ChatMessage,
        __module__=__name__,
        role=(other_role, ...),
        content=(str | list[TextPart] | None, Field(None)),
    )
    roles = {"user": ("user",), "other": ("system", "developer", "assistant", "tool")}
    messages: Any = list[
        Annotated[Annotated[user, Tag("user")] | Annotated[other, Tag("other")], discriminated_by("role", roles)]
    ]
    return create_model(
        "ChatCompletionRequest",
        __base__=ChatCompletionRequest,
        __module__=__name__,
        model=(pipeline, Field(description="the pipeline that answers (one of GET /v1/models)")),
        messages=(
            messages,
            Field(
                min_length=1,
                description="the conversation; it needs a user message, and the last one is the question",
                json_schema_extra={
                    "contains": {"type": "object", "properties": {"role": {"const": "user"}}, "required": ["role"]}
                },
            ),
        ),
        max_tokens=(
            integer(1, limits.max_tokens) | None,
            Field(
                None, description=f"tokens of the answer, at most (default {max_tokens}); with max_completion_tokens, the smaller"
            ),
        ),
        max_completion_tokens=(
            integer(1, limits.max_tokens) | None,
            Field(None, description=f"tokens of the answer, at most (default {max_tokens}); with max_tokens, the smaller"),
        ),
    )


# -- responses ----------------------------------------------------------------------------------


class Model(BaseModel):
    """A model a client may name in `model`: here, a pipeline."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "telerag"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Model]


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(0, description="of prompt_tokens, those the engine's prefix cache held (not prefilled)")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)

    @classmethod
    def of(cls, result: RagResult) -> Usage:
        """Every LLM call's prompt, and every token generated."""
        prompt = result.prompt_tokens
        return cls(
            prompt_tokens=prompt,
            completion_tokens=result.tokens_generated,
            total_tokens=prompt + result.tokens_generated,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=result.cached_tokens),
        )


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatCompletionChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: Literal["stop", "length"] = "stop"


SOURCES = (
    "an extension (the SDKs keep it in `model_extra`): the passages the answer was written from; "
    "[] with `return_documents: false`"
)


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChoice]
    usage: Usage
    documents: list[RetrievedPassageOut] = Field(description=SOURCES)
    ingestion: IngestionInfo | None = Field(None, description=f"an extension: {ANSWERED_WHILE_INGESTING}")

    @classmethod
    def from_result(
        cls, result: RagResult, *, request_id: str, model: str, with_documents: bool, ingestion: IngestionProgress | None
    ) -> ChatCompletion:
        choice = ChatCompletionChoice(message=AssistantMessage(content=result.answer), finish_reason=finish_reason(result))
        documents = passages_out(result.documents) if with_documents else []
        return cls(
            id=request_id,
            model=model,
            usage=Usage.of(result),
            choices=[choice],
            documents=documents,
            ingestion=None if ingestion is None else IngestionInfo.of(ingestion),
        )


def answer_cut(result: RagResult) -> bool:
    """Whether the token limit or the deadline cut the answer (`RagResult.finish_reason`).
    OpenAI's closed sets have no word for a server's deadline, and their clients may refuse a
    value outside them: both are reported as the limit (`length`, `max_output_tokens`)."""
    return result.finish_reason != "stop"


def finish_reason(result: RagResult) -> Literal["stop", "length"]:
    return "length" if answer_cut(result) else "stop"


class ChatDelta(BaseModel):
    """What a chunk adds: the role once, first; then pieces of the content."""

    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    finish_reason: Literal["stop", "length"] | None = None

    @field_serializer("delta")
    def _delta(self, delta: ChatDelta) -> dict[str, str]:
        return delta.model_dump(exclude_none=True)  # OpenAI sends only what a delta sets


class ChatCompletionChunk(BaseModel):
    """One server-sent event of a streamed chat completion (`data: {...}`, then `data: [DONE]`)."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChunkChoice] = Field(description="empty in the usage chunk")
    documents: list[RetrievedPassageOut] | None = Field(None, description=f"in the chunk with `finish_reason` only: {SOURCES}")
    usage: Usage | None = Field(None, description='last, with `stream_options: {"include_usage": true}` only')
    ingestion: IngestionInfo | None = Field(
        None, description=f"in the first chunk only, and only while it is so: an extension: {ANSWERED_WHILE_INGESTING}"
    )
