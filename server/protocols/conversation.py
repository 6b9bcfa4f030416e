"""What both OpenAI APIs (`protocols.openai`, `protocols.responses`) make of a conversation: the
question, the instructions for its answer, and the turns that make it a follow-up."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, ClassVar, Protocol

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from telerag.pipelines.types import Turn
from telerag.server.protocols.file_search import FileSearchTool, file_search_only

HISTORY_TURNS = 6  # of a conversation, what the standalone question is written from


class Texted(Protocol):
    """A text part of either API."""

    @property
    def text(self) -> str: ...


class Said(Texted, Protocol):
    """A message of either API, as `Conversation` reads it."""

    @property
    def role(self) -> str: ...


def content_text(content: str | Sequence[Texted] | None) -> str:
    """A message's text: its string, or its text parts one per line."""
    if content is None or isinstance(content, str):
        return content or ""
    return "\n".join(part.text for part in content)


class Conversation(BaseModel):
    """What both OpenAI APIs ask: `model` (a pipeline) answers the last user message of a
    conversation (`said`); the system and developer messages instruct the answer; the user and
    assistant turns before the question make it a follow-up. Its run is admitted by
    `routes.openai.admit`."""

    model_config = ConfigDict(strict=True, extra="forbid")

    QUERY_FIELD: ClassVar[str]  # the field a question too long for the prompt is blamed on
    model: str
    temperature: float = Field(0.0, ge=0.0, le=2.0)
    top_p: float = Field(
        1.0, ge=0.0, le=1.0, description="nucleus sampling, with temperature > 0 (every LLM call of the request)"
    )
    user: str | None = Field(None, description="the end user's id, as OpenAI takes it; not used")
    return_documents: bool = Field(
        True, description="an extension: false leaves out `documents`, the passages the answer was written from"
    )
    tools: Annotated[list[FileSearchTool], Field(max_length=1), BeforeValidator(file_search_only)] | None = Field(
        None, description="one file_search tool at most: the answer is written from those vector stores instead"
    )

    @property
    def file_search(self) -> FileSearchTool | None:
        return self.tools[0] if self.tools else None

    @property
    def said(self) -> Sequence[Said]:
        raise NotImplementedError

    @property
    def token_limit(self) -> int | None:
        """The answer's token limit (None: the server's default)."""
        raise NotImplementedError

    @property
    def stops(self) -> tuple[str, ...]:
        return ()

    @property
    def preamble(self) -> str:
        """Instructions given apart from the messages, before theirs."""
        return ""

    @property
    def question(self) -> str:
        return next(m.text for m in reversed(self.said) if m.role == "user")

    @property
    def history(self) -> tuple[Turn, ...]:
        """The user and assistant turns before the question (the last `HISTORY_TURNS`): with any,
        the question is made to stand alone before anything is retrieved."""
        said = self.said
        last = max(at for at, m in enumerate(said) if m.role == "user")
        turns = [
            Turn("user" if m.role == "user" else "assistant", m.text)
            for m in said[:last]
            if m.role in ("user", "assistant") and m.text.strip()
        ]
        return tuple(turns[-HISTORY_TURNS:])

    @property
    def instructions_for_answer(self) -> str:
        """The preamble, then the system and developer messages, in order."""
        given = [self.preamble, *(m.text for m in self.said if m.role in ("system", "developer"))]
        return "\n".join(text for text in given if text.strip())
