"""The models of `/v1/documents` (`routes/documents.py`): documents written into the live datastore,
read back, listed. The request models carry the app's limits (`documents_request_models`), so the
schema says what the server takes."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, create_model

from telerag.config.settings import DocumentSettings
from telerag.documents.ingestion import IngestionProgress
from telerag.documents.rebuilds import Rebuild
from telerag.documents.writer import NON_BLANK, DocumentText, DocumentWriter
from telerag.retrieval.documents import DocumentEntry, WriteOutcome, WriteResult
from telerag.server.protocols.common import INTEGRAL
from telerag.server.protocols.ops import IngestionInfo, LiveInfo

MAX_ID_CHARS = 512
MAX_TITLE_CHARS = 1024
MAX_METADATA_KEYS = 16  # as OpenAI's attributes
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512

MetadataValue = Annotated[str, Field(max_length=MAX_METADATA_VALUE_CHARS)] | int | float | bool
Metadata = Annotated[
    dict[Annotated[str, Field(min_length=1, max_length=MAX_METADATA_KEY_CHARS)], MetadataValue],
    Field(max_length=MAX_METADATA_KEYS, description=f"at most {MAX_METADATA_KEYS} keys; values text, numbers or booleans"),
]
DocumentId = Annotated[str, Field(min_length=1, max_length=MAX_ID_CHARS, pattern=NON_BLANK, description="the caller's own id")]


class DocumentFields(BaseModel):
    """What a document is made of; its id is optional (`PUT /v1/documents/{id}` takes it from the
    path, and a body's id other than the path's is a 400)."""

    model_config = ConfigDict(strict=True, extra="forbid")

    id: DocumentId | None = Field(None, description="the path's id, if given at all (another is a 400)")
    text: str = Field(
        min_length=1, pattern=NON_BLANK, description="the document's text (cut into passages by the datastore's rule)"
    )
    title: str | None = Field(None, max_length=MAX_TITLE_CHARS, description="default: the id")
    metadata: Metadata = Field(default_factory=dict)

    def document(self, doc_id: str) -> DocumentText:
        return DocumentText(doc_id, self.text, self.title or "", dict(self.metadata))


class DocumentIn(DocumentFields):
    id: DocumentId

    def as_text(self) -> DocumentText:
        return self.document(self.id)


class DocumentBatch(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    documents: list[DocumentIn]


def _one_or_batch(value: Any) -> str:
    return "a batch" if isinstance(value, dict) and "documents" in value else "one document"


def documents_request_models(limits: DocumentSettings) -> tuple[Any, type[DocumentFields]]:
    """This app's body of `POST /v1/documents` (one document, or `{"documents": [...]}` of at most
    `limits.max_documents`) and of `PUT /v1/documents/{id}`, their texts bounded by the body's limit."""
    text = (str, Field(min_length=1, max_length=limits.max_body_bytes, pattern=NON_BLANK, description="the document's text"))
    fields = create_model("DocumentFields", __base__=DocumentFields, __module__=__name__, text=text)
    one = create_model("DocumentIn", __base__=DocumentIn, __module__=__name__, text=text)
    batch = create_model(
        "DocumentBatch",
        __base__=DocumentBatch,
        __module__=__name__,
        documents=(list[one], Field(min_length=1, max_length=limits.max_documents)),
    )
    write = Annotated[Annotated[one, Tag("one document")] | Annotated[batch, Tag("a batch")], Discriminator(_one_or_batch)]
    return write, fields


class WrittenDocument(BaseModel):
    """A write's outcome: durable and searchable by every search that starts after this answer."""

    object: Literal["document"] = "document"
    id: str
    outcome: Literal["created", "replaced", "unchanged"]
    version: int = Field(description="the document's version now (1 when first written)")
    passages: int = Field(description="passages it is cut into")
    lsn: int = Field(description="the write's position in the datastore's log: a snapshot at or past it shows it")

    @classmethod
    def of(cls, result: WriteResult) -> WrittenDocument:
        entry = result.document
        assert entry is not None, "an upsert's result holds the document"
        return cls(
            id=result.doc_id, outcome=result.outcome.value, version=entry.version, passages=len(entry.passage_ids), lsn=result.lsn
        )


class WrittenDocuments(BaseModel):
    object: Literal["list"] = "list"
    data: list[WrittenDocument]
    lsn: int = Field(description="the last write's position: a snapshot at or past it shows them all")

    @classmethod
    def of(cls, results: list[WriteResult]) -> WrittenDocuments:
        return cls(data=[WrittenDocument.of(r) for r in results], lsn=max(r.lsn for r in results))


class DocumentSummary(BaseModel):
    object: Literal["document"] = "document"
    id: str
    title: str
    version: int
    state: Literal["indexed"] = Field("indexed", description="indexed: durable and searchable")
    passage_count: int
    content_hash: str | None = Field(description="sha256 of its title, text and metadata (null: built offline)")
    metadata: dict[str, str | int | float | bool]
    lsn: int = Field(description="the write that made this version (0: the datastore's build)")
    updated_at: int | None = Field(description="when, Unix seconds (null: at the build)")

    @classmethod
    def of(cls, entry: DocumentEntry) -> DocumentSummary:
        return cls(
            id=entry.doc_id,
            title=entry.title,
            version=entry.version,
            passage_count=len(entry.passage_ids),
            content_hash=entry.content_hash,
            metadata=dict(entry.metadata),
            lsn=entry.lsn,
            updated_at=None if entry.updated_at is None else int(entry.updated_at),
        )


class PassageOut(BaseModel):
    id: int = Field(description="the passage's id: a retrieved document's `id`")
    text: str


class DocumentOut(DocumentSummary):
    passages: list[PassageOut] = Field(description="its passages, in order")


class DocumentList(BaseModel):
    object: Literal["list"] = "list"
    data: list[DocumentSummary]
    has_more: bool
    last_id: str | None = Field(description="the page's last id: pass it as `after` for the next page")


class DeletedDocument(BaseModel):
    object: Literal["document.deleted"] = "document.deleted"
    id: str
    deleted: Literal[True] = True
    lsn: int

    @classmethod
    def of(cls, result: WriteResult) -> DeletedDocument:
        assert result.outcome is WriteOutcome.DELETED
        return cls(id=result.doc_id, lsn=result.lsn)


def live_info(writer: DocumentWriter, ingestion: IngestionProgress | None) -> LiveInfo:
    """The datastore's writes (and its ingestion, if one goes on) as `/ready` and `/v1/datastore` report them."""
    stats = writer.stats()
    return LiveInfo(
        writable=writer.live.writable,
        generation=stats.generation,
        lsn=stats.lsn,
        documents=stats.documents,
        passages=stats.passages,
        delta_rows=stats.delta_rows,
        tombstones=stats.tombstones,
        wal_bytes=stats.wal_bytes,
        list_imbalance=round(stats.imbalance, 3),
        ingestion=None if ingestion is None else IngestionInfo.of(ingestion),
    )


class RetrainRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    nlist: Annotated[int, Field(ge=1), INTEGRAL] | None = Field(
        None,
        description="lists of the new generation (default: about 4·sqrt(passages)); at most the datastore's passages "
        "(GET /v1/datastore: live.passages), 422 otherwise",
    )


class RebuildOut(BaseModel):
    """A compaction (the same results) or a retrain (new centroids: results change)."""

    kind: Literal["compact", "retrain"]
    state: Literal["running", "done", "failed"]
    automatic: bool = Field(description="begun by itself (documents.compact_share), not asked for")
    started_at: int
    finished_at: int | None
    generation: int | None = Field(description="the new generation, once done")
    passages: int | None = Field(description="its passages, once done")
    carried: int | None = Field(description="writes made while it was built, carried into it")
    seconds: float | None
    changes_results: bool = Field(description="a retrain: searches may answer otherwise from the new generation on")
    error: str | None

    @classmethod
    def of(cls, rebuild: Rebuild) -> RebuildOut:
        result = rebuild.result
        return cls(
            kind=rebuild.kind.value,
            state=rebuild.state.value,
            automatic=rebuild.automatic,
            started_at=int(rebuild.started_at),
            finished_at=None if rebuild.finished_at is None else int(rebuild.finished_at),
            generation=None if result is None else result.generation,
            passages=None if result is None else result.passages,
            carried=None if result is None else result.carried,
            seconds=None if result is None else round(result.seconds, 3),
            changes_results=rebuild.kind.value == "retrain",
            error=rebuild.error,
        )


class DatastoreState(BaseModel):
    live: LiveInfo
    rebuild: RebuildOut | None = Field(description="the running compaction or retrain, else the last one (null: none yet)")
