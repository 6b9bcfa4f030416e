"""What the HTTP APIs' models share: the error body, the checks of a question, a pipeline's name
and a bounded integer, the refusal of what is not served (400), documents as answered, and a
request's id."""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    Discriminator,
    Field,
    GetCoreSchemaHandler,
    GetJsonSchemaHandler,
    StringConstraints,
)
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import CoreSchema, PydanticCustomError, core_schema

from telerag.config.settings import LimitSettings
from telerag.pipelines.types import RetrievedPassage

# A query needs one character that is not white space. Spelled out rather than `\S`, whose
# meaning differs between regex engines (U+0085 and U+FEFF): so pydantic, JSON Schema (ECMA-262)
# and a client's validator agree on which queries are blank.
NON_BLANK = r"[^\t\n\x0b\f\r \u0085\u00a0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000\ufeff]"


def _integral(value: Any) -> Any:
    """JSON Schema counts 2.0 as an integer, so the server does too (but never "2" or true)."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


INTEGRAL = BeforeValidator(_integral)  # after an int's Field(ge=, le=) in its Annotated, so that the schema keeps its bounds


def integer(low: int | None, high: int | None) -> Any:
    """An integer in [low, high] (no bound on a side that is None); 2.0 counts, "2" and true do not."""
    return Annotated[int, Field(ge=low, le=high), INTEGRAL]


class ErrorDetail(BaseModel):
    """What went wrong, with OpenAI's keys too (`param`, `code`), so that OpenAI clients read it."""

    type: str = Field(
        description="a stable slug, e.g. invalid_request, body_too_large, queue_full, not_found; on the OpenAI routes "
        "(/v1/chat/completions, /v1/models) OpenAI's class of error instead: invalid_request_error, "
        "authentication_error, rate_limit_error or server_error"
    )
    message: str = Field(description="what went wrong, for a human")
    field: str | None = Field(None, description="the request field at fault (dotted path), when there is one")
    param: str | None = Field(None, description="the same as `field`, by OpenAI's name")
    code: str | None = Field(None, description="the slug, on every route (where `type` is OpenAI's class, the reason)")


class ErrorResponse(BaseModel):
    """The body of every error the server answers, whatever its status."""

    error: ErrorDetail


UNSUPPORTED = "unsupported"  # a pydantic error type: the request asks for what this server does not do (400, not 422)


def refuse(message: str) -> PydanticCustomError:
    return PydanticCustomError(UNSUPPORTED, message)


@dataclass(frozen=True)
class NullOnly:
    """The metadata of a field that takes null only (or is left out): one OpenAI's clients may send that is not
    served, or one the request's other fields leave no room for. The schema says null; any other value is refused
    with `why`, a 400 naming the field (`refuse`), before its type is looked at."""

    why: str

    def __get_pydantic_core_schema__(self, source: Any, handler: GetCoreSchemaHandler) -> CoreSchema:
        def null_only(value: Any) -> Any:
            if value is not None:
                raise refuse(self.why)
            return value

        return core_schema.no_info_before_validator_function(null_only, handler(source))

    def __get_pydantic_json_schema__(self, schema: CoreSchema, handler: GetJsonSchemaHandler) -> JsonSchemaValue:
        return {"type": "null"}


def discriminated_by(key: str, members: Mapping[str, Sequence[str]]) -> Discriminator:
    """A union's discriminator: the member tagged `tag` (`Tag(tag)` in the union) takes the values
    `members[tag]` of `key`. Published without OpenAPI's `discriminator` mapping, which a member
    that several values name (`ne`, `gt`, ... of one comparison) turns into overlapping branches:
    a fuzzer then mutates a value into another branch of the same member and takes the valid
    request it made for an invalid one (schemathesis 4.32, its check ST201). The members' own
    `key` enums keep them apart in the schema."""
    tags = {value: tag for tag, values in members.items() for value in values}

    def tag_of(data: Any) -> str | None:
        value = data.get(key) if isinstance(data, dict) else getattr(data, key, None)
        return tags.get(value) if isinstance(value, str) else None

    return Discriminator(tag_of, custom_error_type="union_member", custom_error_message=f"{key} must be one of {', '.join(tags)}")


def pipeline_name(pipelines: Sequence[str]) -> Any:
    """A field that names one of the served pipelines."""
    return Literal[tuple(pipelines)]


def question_text(limits: LimitSettings) -> Any:
    """A question: not blank, at most `limits.max_query_chars` characters."""
    return Annotated[str, StringConstraints(min_length=1, max_length=limits.max_query_chars, pattern=NON_BLANK)]


def default_max_tokens(limits: LimitSettings) -> int:
    """An answer's token limit when a request names none (a chat completion's as a query's)."""
    return min(256, limits.max_tokens)


# -- responses ----------------------------------------------------------------------------------


class RetrievedPassageOut(BaseModel):
    id: int
    doc_id: str
    title: str
    text: str
    score: float
    source: str = Field("", description="the vector store it came from (a file_search tool's); empty: the server's datastore")


def passages_out(documents: Sequence[RetrievedPassage]) -> list[RetrievedPassageOut]:
    return [RetrievedPassageOut(**vars(d)) for d in documents]


def new_request_id() -> str:
    return uuid.uuid4().hex[:24]
