"""The models of `POST /v1/embeddings` (`routes/embeddings.py`), as OpenAI clients send and read them."""

from __future__ import annotations

from base64 import b64encode
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model, field_validator

from telerag.config.settings import LimitSettings
from telerag.pipelines.types import TextEmbeddings
from telerag.server.protocols.common import INTEGRAL, refuse


class EmbeddingRequest(BaseModel):
    """`POST /v1/embeddings`: texts embedded as the datastore's passages are. `model` must name
    the datastore's embedder, as `GET /ready` does (`datastore.embedder`); the texts' bounds are
    set per app (`embedding_request_model`)."""

    model_config = ConfigDict(strict=True, extra="forbid")

    model: str = Field(description="the datastore's embedder (GET /ready: datastore.embedder)")
    input: str | list[str]
    encoding_format: Literal["float", "base64"] = Field(
        "float", description="base64: each vector's little-endian float32 bytes (the openai SDK asks for it)"
    )
    dimensions: Annotated[int, Field(ge=1), INTEGRAL] | None = Field(
        None, description="only the embedder's own size (GET /ready: datastore.dim)"
    )
    user: str | None = Field(None, description="the end user's id, as OpenAI takes it; not used")

    @field_validator("input", mode="before")
    @classmethod
    def _text_only(cls, value: Any) -> Any:
        if isinstance(value, list) and any(isinstance(item, int | list) for item in value):
            raise refuse(
                "only text: token ids mean nothing to this embedder (LangChain's OpenAIEmbeddings sends them "
                "unless check_embedding_ctx_length=False)"
            )
        return value

    @property
    def texts(self) -> list[str]:
        return [self.input] if isinstance(self.input, str) else self.input


def embedding_request_model(limits: LimitSettings) -> type[EmbeddingRequest]:
    """`EmbeddingRequest` for one app: at most `limits.max_embedding_inputs` texts, none empty."""
    text: Any = Annotated[str, Field(min_length=1)]
    return create_model(
        "EmbeddingRequest",
        __base__=EmbeddingRequest,
        __module__=__name__,
        input=(
            text | Annotated[list[text], Field(min_length=1, max_length=limits.max_embedding_inputs)],
            Field(description=f"a text, or a list of at most {limits.max_embedding_inputs} (none empty)"),
        ),
    )


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str = Field(description="floats, or their base64 (encoding_format)")


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage

    @classmethod
    def of(cls, embedded: TextEmbeddings, *, model: str, base64: bool) -> EmbeddingList:
        rows = [b64encode(row.astype("<f4").tobytes()).decode() if base64 else row.tolist() for row in embedded.vectors]
        return cls(
            data=[Embedding(index=i, embedding=row) for i, row in enumerate(rows)],
            model=model,
            usage=EmbeddingUsage(prompt_tokens=embedded.tokens, total_tokens=embedded.tokens),
        )
