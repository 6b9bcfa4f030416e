"""OpenAI's `file_search` tool, as both OpenAI APIs take it (`protocols.conversation`): the
request's pipeline runs over the named vector stores instead of the server's datastore
(`file_search.store_retriever`); a response says so with its `file_search_call` item and cites the
files its answer was written from (`file_citation` annotations)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Annotated, Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from telerag.file_search.attribute_filters import Attributes
from telerag.file_search.store_retriever import StoresRetriever
from telerag.file_search.vector_stores import VectorStores
from telerag.pipelines.types import RagResult, RetrievedPassage
from telerag.retrieval.ranking import Ranking
from telerag.server.protocols.common import INTEGRAL, refuse
from telerag.server.protocols.vector_stores import Filter, RankingOptions

MAX_TOOL_STORES = 16


class FileSearchTool(BaseModel):
    """`{"type": "file_search", "vector_store_ids": [...]}`: the answer is written from the top
    `max_num_results` passages (the server's `top_k` when unset) of those stores, merged exactly."""

    model_config = ConfigDict(strict=True, extra="forbid")

    type: Literal["file_search"]
    vector_store_ids: list[Annotated[str, StringConstraints(min_length=1, max_length=64)]] = Field(
        min_length=1, max_length=MAX_TOOL_STORES, description="the API key's own stores (another's is 404)"
    )
    max_num_results: Annotated[int, Field(ge=1, le=50), INTEGRAL] | None = Field(
        None, description="passages the answer is written from"
    )
    filters: Filter | None = Field(None, description="on the files' attributes, as a vector store's search takes them")
    ranking_options: RankingOptions | None = None

    def retriever(self, stores: VectorStores, client: str | None, rankings: Rankings) -> StoresRetriever:
        """What the request's pipeline retrieves from: the key's stores it names, as they are now
        (404 for one that is not the key's; 501 where no stores are served); `ranking_options` rank
        every search of it (`hybrid_search` weights make them hybrid; `ranker` none leaves out the
        re-ranker). It reads the stores' records: call it in a worker thread."""
        where = None if self.filters is None else self.filters.to_filter()
        views = stores.views(self.vector_store_ids, client, where)
        options = self.ranking_options
        if options is None:
            return StoresRetriever(views, stores.searcher)
        ranking = rankings(weights=options.weights, rerank=options.ranker != "none")
        return StoresRetriever(views, stores.searcher, options.score_threshold, ranking)


class Rankings(Protocol):
    """The service's rankings (`Service.ranking`): hybrid with `weights`, re-ranked unless not `rerank`."""

    def __call__(self, *, weights: tuple[float, float] | None, rerank: bool) -> Ranking: ...


def file_search_only(tools: Any) -> Any:
    """Only one `file_search` tool is served: any other tool is refused by name (no function is
    called here), before the tools are read."""
    if isinstance(tools, list):
        for at, tool in enumerate(tools):
            if isinstance(tool, dict) and isinstance(kind := tool.get("type"), str) and kind != "file_search":
                raise refuse(f"only the file_search tool: tool {at} is a {kind}")
        if len(tools) > 1:
            raise refuse("one file_search tool at most (it takes several vector_store_ids)")
    return tools


class FileSearchResult(BaseModel):
    file_id: str
    filename: str
    score: float
    text: str
    attributes: dict[str, str | float | bool]


class FileSearchCall(BaseModel):
    """The `file_search_call` output item: the searches the pipeline ran, and (with `include`
    asking for `file_search_call.results`) the passages the answer was written from."""

    type: Literal["file_search_call"] = "file_search_call"
    id: str
    status: Literal["in_progress", "searching", "completed", "incomplete", "failed"]
    queries: list[str] = Field(default_factory=list)
    results: list[FileSearchResult] | None = None

    @classmethod
    def of(
        cls,
        call_id: str,
        result: RagResult,
        queries: Sequence[str],
        attributes: Callable[[RetrievedPassage], Attributes],
        *,
        with_results: bool,
    ) -> FileSearchCall:
        results = [
            FileSearchResult(file_id=d.doc_id, filename=d.title, score=d.score, text=d.text, attributes=dict(attributes(d)))
            for d in result.documents
        ]
        return cls(id=call_id, status="completed", queries=list(queries), results=results if with_results else None)


class FileCitation(BaseModel):
    type: Literal["file_citation"] = "file_citation"
    file_id: str
    filename: str
    index: int


def citations(documents: Sequence[RetrievedPassage], answer: str) -> list[FileCitation]:
    """Each file the answer was written from, once, best first, cited at the answer's end."""
    files = dict.fromkeys((d.doc_id, d.title) for d in sorted(documents, key=lambda d: -d.score))
    return [FileCitation(file_id=file_id, filename=filename, index=len(answer)) for file_id, filename in files]
