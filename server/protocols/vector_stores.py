"""The models of OpenAI's Vector Stores API (`routes/vector_stores.py`, `routes/vector_store_files.py`),
in OpenAI's shape, so that the openai SDK's `client.vector_stores` (its `create_and_poll` and
`upload_and_poll` too) reads them unchanged. A field the server does not serve yet (`expires_after`)
is refused with a 400 naming it."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, Tag, ValidationInfo, create_model, field_validator

from telerag.config.settings import LimitSettings
from telerag.documents.writer import NON_BLANK
from telerag.file_search.attribute_filters import Comparison, Compound
from telerag.file_search.vector_store_records import Attach, FileCounts, StaticChunking, StoreHit, StoreRecord
from telerag.server.protocols.common import INTEGRAL, NullOnly, discriminated_by

FileId = Annotated[str, StringConstraints(min_length=1, max_length=64)]
Metadata = Annotated[
    dict[Annotated[str, StringConstraints(max_length=64)], Annotated[str, StringConstraints(max_length=512)]],
    Field(max_length=16, description="at most 16 keys of at most 64 characters, values of at most 512"),
]
Attribute = bool | float | Annotated[str, StringConstraints(max_length=512)]
Attributes = Annotated[
    dict[Annotated[str, StringConstraints(max_length=64)], Attribute],
    Field(max_length=16, description="at most 16 keys of at most 64 characters; values strings (512), numbers, booleans"),
]
MAX_BATCH_FILES = 2000  # as OpenAI's


NoExpiry = Annotated[
    None,
    NullOnly("not served yet: a vector store stays until it is deleted"),
    Field(description="not served yet (null only): a vector store stays until it is deleted"),
]


# -- requests -----------------------------------------------------------------------------------


class Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class AutoChunking(Request):
    type: Literal["auto"]


class StaticSizes(Request):
    max_chunk_size_tokens: Annotated[int, Field(ge=100, le=4096), INTEGRAL] = Field(
        description="the embedder's tokens of a passage, at most"
    )
    chunk_overlap_tokens: Annotated[int, Field(ge=0, le=2048), INTEGRAL] = Field(
        description="tokens each passage repeats of the one before: at most half of max_chunk_size_tokens (422 otherwise)"
    )

    @field_validator("chunk_overlap_tokens")
    @classmethod
    def _at_most_half(cls, value: int, info: ValidationInfo) -> int:
        size = info.data.get("max_chunk_size_tokens")
        if size is not None and value > size // 2:
            raise ValueError(f"at most half of max_chunk_size_tokens ({size // 2})")
        return value


class StaticChunkingIn(Request):
    type: Literal["static"]
    static: StaticSizes


ChunkingIn = Annotated[
    AutoChunking | StaticChunkingIn,
    Field(
        discriminator="type",
        description="auto: the server's own passage rule; static: sizes in the embedder's tokens, mapped onto it",
    ),
]


def chunking_of(strategy: AutoChunking | StaticChunkingIn | None) -> StaticChunking | None:
    if not isinstance(strategy, StaticChunkingIn):
        return None
    return StaticChunking(strategy.static.max_chunk_size_tokens, strategy.static.chunk_overlap_tokens)


class VectorStoreCreate(Request):
    name: Annotated[str, StringConstraints(max_length=256)] = ""
    file_ids: Annotated[list[FileId], Field(max_length=MAX_BATCH_FILES)] = Field(default_factory=list)
    chunking_strategy: ChunkingIn | None = None
    metadata: Metadata | None = None
    description: Annotated[str, StringConstraints(max_length=512)] | None = None
    expires_after: NoExpiry = None

    @property
    def attach(self) -> list[Attach]:
        return [Attach(i, {}, chunking_of(self.chunking_strategy)) for i in dict.fromkeys(self.file_ids)]


class VectorStoreModify(Request):
    name: Annotated[str, StringConstraints(max_length=256)] | None = None
    metadata: Metadata | None = None
    expires_after: NoExpiry = None


class HybridSearch(Request):
    """OpenAI's weights of reciprocal rank fusion between the search by meaning and by words."""

    model_config = ConfigDict(
        json_schema_extra={  # not both 0, in the schema as in the validator
            "not": {
                "required": ["embedding_weight", "text_weight"],
                "properties": {"embedding_weight": {"const": 0}, "text_weight": {"const": 0}},
            }
        }
    )

    embedding_weight: float = Field(
        ge=0, allow_inf_nan=False, description="the weight of the embeddings' ranks (dense, IVF at nprobe)"
    )
    text_weight: float = Field(ge=0, allow_inf_nan=False, description="the weight of the words' ranks (BM25)")

    @field_validator("text_weight")
    @classmethod
    def _one_weighs(cls, value: float, info: ValidationInfo) -> float:
        if value == 0 and info.data.get("embedding_weight") == 0:
            raise ValueError("embedding_weight and text_weight are both 0: one must weigh something")
        return value

    @property
    def weights(self) -> tuple[float, float]:
        return self.embedding_weight, self.text_weight


class RankingOptions(Request):
    ranker: Literal["none", "auto", "default-2024-11-15"] = Field(
        "auto",
        description="auto and default-2024-11-15: the candidates reordered by the server's re-ranker "
        "(retrieval.reranker), the scores its own; none, or no re-ranker configured: the search's own order and scores",
    )
    score_threshold: float = Field(
        0.0, ge=0, le=1, description="results scoring below it are left out (a hybrid search's scores lie in [0, 1])"
    )
    hybrid_search: HybridSearch | None = Field(
        None,
        description="search by meaning and by words together, their ranks fused with these weights (reciprocal rank "
        "fusion, k 60; the score is the fused one over its most, in [0, 1]); null: the server's retrieval.search_mode",
    )

    @property
    def weights(self) -> tuple[float, float] | None:
        return None if self.hybrid_search is None else self.hybrid_search.weights


COMPARISONS = ("eq", "ne", "gt", "gte", "lt", "lte")
MEMBERSHIPS = ("in", "nin")
COMPOUNDS = ("and", "or")


class ComparisonFilter(Request):
    """OpenAI's comparison of a file's attribute with one value (`file_search.attribute_filters`)."""

    type: Literal["eq", "ne", "gt", "gte", "lt", "lte"]
    key: Annotated[str, StringConstraints(min_length=1, max_length=64)]
    value: Attribute

    def to_filter(self) -> Comparison:
        return Comparison(self.type, self.key, self.value)


class MembershipFilter(Request):
    """OpenAI's `in` / `nin`: whether a file's attribute is one of a list of values."""

    type: Literal["in", "nin"]
    key: Annotated[str, StringConstraints(min_length=1, max_length=64)]
    value: Annotated[list[bool | float | Annotated[str, StringConstraints(max_length=512)]], Field(max_length=512)]

    def to_filter(self) -> Comparison:
        return Comparison(self.type, self.key, tuple(self.value))


Compared = Annotated[
    Annotated[ComparisonFilter, Tag("comparison")] | Annotated[MembershipFilter, Tag("membership")],
    discriminated_by("type", {"comparison": COMPARISONS, "membership": MEMBERSHIPS}),
]


class NestedCompoundFilter(Request):
    """An `and` / `or` of comparisons, inside another."""

    type: Literal["and", "or"]
    filters: list[Compared] = Field(min_length=1, max_length=64)

    def to_filter(self) -> Compound:
        return Compound(self.type, tuple(f.to_filter() for f in self.filters))


class CompoundFilter(Request):
    """OpenAI's `and` / `or` of filters: of comparisons, or of `and` / `or`s of comparisons (two
    levels hold any filter in conjunctive or disjunctive form; the schema names no deeper one, so
    that it stays one a generator of requests can walk)."""

    type: Literal["and", "or"]
    filters: list[
        Annotated[
            Annotated[ComparisonFilter, Tag("comparison")]
            | Annotated[MembershipFilter, Tag("membership")]
            | Annotated[NestedCompoundFilter, Tag("compound")],
            discriminated_by("type", {"comparison": COMPARISONS, "membership": MEMBERSHIPS, "compound": COMPOUNDS}),
        ]
    ] = Field(min_length=1, max_length=64)

    def to_filter(self) -> Compound:
        return Compound(self.type, tuple(f.to_filter() for f in self.filters))


Filter = Annotated[
    Annotated[ComparisonFilter, Tag("comparison")]
    | Annotated[MembershipFilter, Tag("membership")]
    | Annotated[CompoundFilter, Tag("compound")],
    discriminated_by("type", {"comparison": COMPARISONS, "membership": MEMBERSHIPS, "compound": COMPOUNDS}),
]


class SearchRequest(Request):
    """`POST /v1/vector_stores/{id}/search`; the query's bounds are set per app (`search_request_model`)."""

    query: str | list[str]
    max_num_results: Annotated[int, Field(ge=1, le=50), INTEGRAL] = 10
    ranking_options: RankingOptions | None = None
    filters: Filter | None = Field(
        None, description="on the files' attributes: the search is exact over the passages of the files it matches"
    )
    rewrite_query: bool = Field(
        False,
        description="true: the query (a list's texts in turn, as one) is first asked about its topic, which a short "
        "LLM call names, and that is searched (the page's search_query); false: the query is searched as given",
    )

    @property
    def queries(self) -> list[str]:
        return [self.query] if isinstance(self.query, str) else self.query


def search_request_model(limits: LimitSettings) -> type[SearchRequest]:
    """`SearchRequest` for one app: each query text as a question is (`limits.max_query_chars`, not blank)."""
    text: Any = Annotated[str, StringConstraints(min_length=1, max_length=limits.max_query_chars, pattern=NON_BLANK)]
    return create_model(
        "SearchRequest",
        __base__=SearchRequest,
        __module__=__name__,
        query=(
            text | Annotated[list[text], Field(min_length=1, max_length=32)],
            Field(description="a text, or up to 32 (their embeddings' mean is searched)"),
        ),
    )


# -- responses ----------------------------------------------------------------------------------


class FileCountsOut(BaseModel):
    in_progress: int
    completed: int
    failed: int
    cancelled: int
    total: int

    @classmethod
    def of(cls, counts: FileCounts) -> FileCountsOut:
        return cls(
            in_progress=counts.in_progress,
            completed=counts.completed,
            failed=counts.failed,
            cancelled=counts.cancelled,
            total=counts.total,
        )


class VectorStoreObject(BaseModel):
    id: str
    object: Literal["vector_store"] = "vector_store"
    created_at: int = Field(description="Unix seconds")
    name: str
    description: str | None = None
    usage_bytes: int = Field(description="its files' passages: their text and float32 vectors")
    file_counts: FileCountsOut
    status: Literal["in_progress", "completed"] = Field(description="in_progress while a file is")
    expires_after: None = None
    expires_at: None = Field(None, description="never: a vector store stays until it is deleted")
    last_active_at: int = Field(description="Unix seconds: its last change, or search")
    metadata: dict[str, str]

    @classmethod
    def of(cls, record: StoreRecord) -> VectorStoreObject:
        return cls(
            id=record.id,
            created_at=record.created_at,
            name=record.name,
            description=record.description,
            usage_bytes=record.usage_bytes,
            file_counts=FileCountsOut.of(record.counts),
            status="in_progress" if record.in_progress else "completed",
            last_active_at=record.last_active_at,
            metadata=dict(record.metadata),
        )


class VectorStoreList(BaseModel):
    object: Literal["list"] = "list"
    data: list[VectorStoreObject]
    first_id: str | None
    last_id: str | None
    has_more: bool


class VectorStoreDeleted(BaseModel):
    id: str
    object: Literal["vector_store.deleted"] = "vector_store.deleted"
    deleted: Literal[True] = True


class TextContent(BaseModel):
    type: Literal["text"] = "text"
    text: str


class SearchResult(BaseModel):
    file_id: str
    filename: str
    score: float = Field(description="the inner product of the query's and the passage's embeddings (cosine)")
    attributes: dict[str, bool | float | str]
    content: list[TextContent]

    @classmethod
    def of(cls, hit: StoreHit) -> SearchResult:
        return cls(
            file_id=hit.file_id,
            filename=hit.filename,
            score=hit.score,
            attributes=dict(hit.attributes),
            content=[TextContent(text=hit.text)],
        )


class SearchResultsPage(BaseModel):
    object: Literal["vector_store.search_results.page"] = "vector_store.search_results.page"
    search_query: list[str]
    data: list[SearchResult]
    has_more: Literal[False] = False
    next_page: None = None
