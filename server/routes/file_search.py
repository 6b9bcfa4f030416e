"""A request's `file_search` tool, made into what its pipeline retrieves from: the API key's
vector stores it names, as they are when the request begins (`file_search.store_retriever`)."""

from __future__ import annotations

import asyncio
from typing import Protocol

from fastapi import Request

from telerag.file_search.store_retriever import StoresRetriever
from telerag.file_search.vector_stores import VectorStores
from telerag.retrieval.ranking import Ranking
from telerag.server.protocols.file_search import FileSearchTool


class Rankings(Protocol):
    """The service's rankings (`Service.ranking`): hybrid with `weights`, re-ranked unless not `rerank`."""

    def __call__(self, *, weights: tuple[float, float] | None, rerank: bool) -> Ranking: ...


async def stores_retriever(request: Request, tool: FileSearchTool, client: str | None, rankings: Rankings) -> StoresRetriever:
    """The retriever over `tool`'s stores (404 for one that is not the key's; 501 where no
    stores are served); its `ranking_options` rank every search of it (`hybrid_search` weights make
    them hybrid; `ranker` none leaves out the re-ranker)."""
    stores: VectorStores = request.app.state.vector_stores
    where = None if tool.filters is None else tool.filters.to_filter()
    views = await asyncio.to_thread(stores.views, tool.vector_store_ids, client, where)
    options = tool.ranking_options
    if options is None:
        return StoresRetriever(views, stores.resources)
    ranking = rankings(weights=options.weights, rerank=options.ranker != "none")
    return StoresRetriever(views, stores.resources, options.score_threshold, ranking)
