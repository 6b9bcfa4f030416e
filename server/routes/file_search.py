"""A request's `file_search` tool, made into what its pipeline retrieves from: the API key's
vector stores it names, as they are when the request begins (`pipelines.store_retriever`)."""

from __future__ import annotations

import asyncio

from fastapi import Request

from telerag.pipelines.store_retriever import StoresRetriever
from telerag.pipelines.vector_stores import VectorStores
from telerag.server.protocols.file_search import FileSearchTool
from telerag.server.settings import RetrievalSettings


async def stores_retriever(
    request: Request, tool: FileSearchTool, client: str | None, settings: RetrievalSettings
) -> StoresRetriever:
    """The retriever over `tool`'s stores (404 for one that is not the key's; 501 where no
    stores are served); with `hybrid_search` weights, its searches are hybrid with them."""
    stores: VectorStores = request.app.state.vector_stores
    where = None if tool.filters is None else tool.filters.to_filter()
    views = await asyncio.to_thread(stores.views, tool.vector_store_ids, client, where)
    options = tool.ranking_options
    if options is None:
        return StoresRetriever(views, stores.resources)
    ranking = None if options.weights is None else settings.ranking(weights=options.weights)
    return StoresRetriever(views, stores.resources, options.score_threshold, ranking)
