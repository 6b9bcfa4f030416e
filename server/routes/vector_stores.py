"""OpenAI's Vector Stores API: `POST /v1/vector_stores` (create, with `file_ids`), `GET
/v1/vector_stores`, `GET`, `POST` (modify) and `DELETE /v1/vector_stores/{id}`, `POST
/v1/vector_stores/{id}/search`; the stores kept by `file_search.vector_stores`, each seen only by the
API key that made it. Its files and file batches: `routes/vector_store_files.py`. (The endpoints
have no docstrings: FastAPI would publish them in the schema.)"""

from __future__ import annotations

import asyncio
from typing import Annotated, Literal

from fastapi import APIRouter, Depends, Path, Query, Request
from fastapi.responses import Response

from telerag.file_search.vector_store_records import page
from telerag.file_search.vector_stores import VectorStores
from telerag.server import errors
from telerag.server.admission.admitted_run import CLIENT_CLOSED_REQUEST, ClientDisconnected
from telerag.server.auth import Access
from telerag.server.protocols.vector_stores import (
    SearchRequest,
    SearchResult,
    SearchResultsPage,
    VectorStoreCreate,
    VectorStoreDeleted,
    VectorStoreList,
    VectorStoreModify,
    VectorStoreObject,
)
from telerag.server.routes.signature import typed
from telerag.server.service import Service, serving

VECTOR_STORES = "/v1/vector_stores"
ONE = VECTOR_STORES + "/{vector_store_id}"
PATHS = frozenset({VECTOR_STORES})  # and every path under it: their errors speak OpenAI's dialect (middleware.ErrorDialect)
StoreId = Annotated[str, Path(max_length=64, description="the vector store's id (`vs_…`)")]
Cursor = Annotated[str | None, Query(max_length=64, description="an id of the list: the page starts after it")]
Before = Annotated[str | None, Query(max_length=64, description="an id of the list: the page ends before it")]
Limit = Annotated[int, Query(ge=1, le=100, description="at most this many")]
Order = Annotated[Literal["asc", "desc"], Query(description="by creation: desc, the newest first")]
ERRORS = (404, 422, 501, 503)  # 501: a deployment that embeds nothing in process (Ray's inference replicas)


def router(access: Access, search: type[SearchRequest]) -> APIRouter:
    """The routes, with this app's access and search request model (`search_request_model`)."""
    routes = APIRouter(tags=["vector stores"])
    client = access.client_parameter()
    routes.add_api_route(
        VECTOR_STORES,
        typed(create_store, client=client),
        methods=["POST"],
        response_model=VectorStoreObject,
        responses=errors.responses(400, *access.api_errors, 413, *ERRORS),
        summary="Make a vector store, with files (this key's, from /v1/files) to search",
    )
    routes.add_api_route(
        VECTOR_STORES,
        typed(list_stores, client=client),
        methods=["GET"],
        response_model=VectorStoreList,
        responses=errors.responses(*access.api_errors, 422, 501, 503),
        summary="This API key's vector stores",
    )
    routes.add_api_route(
        ONE,
        typed(get_store, client=client),
        methods=["GET"],
        response_model=VectorStoreObject,
        responses=errors.responses(*access.api_errors, *ERRORS),
        summary="A vector store",
    )
    routes.add_api_route(
        ONE,
        typed(modify_store, client=client),
        methods=["POST"],
        response_model=VectorStoreObject,
        responses=errors.responses(400, *access.api_errors, *ERRORS),
        summary="Rename a vector store, or give it new metadata",
    )
    routes.add_api_route(
        ONE,
        typed(delete_store, client=client),
        methods=["DELETE"],
        response_model=VectorStoreDeleted,
        responses=errors.responses(*access.api_errors, *ERRORS),
        summary="Delete a vector store (its files stay in /v1/files)",
    )
    routes.add_api_route(
        ONE + "/search",
        typed(search_store, body=search, client=client),
        methods=["POST"],
        response_model=SearchResultsPage,
        responses=errors.responses(400, *access.api_errors, *ERRORS, 429, 502, 504),  # 429, 502, 504: rewrite_query's call
        summary="Search a vector store's passages (exact at its lists' default nprobe)",
    )
    return routes


def stores_of(request: Request) -> VectorStores:
    return request.app.state.vector_stores


async def create_store(request: Request, body: VectorStoreCreate, client: str | None) -> VectorStoreObject:
    record = await asyncio.to_thread(
        stores_of(request).create,
        client,
        name=body.name,
        metadata=body.metadata or {},
        description=body.description,
        attach=body.attach,
    )
    return VectorStoreObject.of(record)


async def list_stores(
    request: Request,
    client: str | None,
    limit: Limit = 20,
    order: Order = "desc",
    after: Cursor = None,
    before: Before = None,
) -> VectorStoreList:
    held = await asyncio.to_thread(stores_of(request).stores, client)
    shown, more = page(held, after=after, before=before, limit=limit, newest_first=order == "desc")
    return VectorStoreList(
        data=[VectorStoreObject.of(s) for s in shown],
        first_id=shown[0].id if shown else None,
        last_id=shown[-1].id if shown else None,
        has_more=more,
    )


async def get_store(vector_store_id: StoreId, request: Request, client: str | None) -> VectorStoreObject:
    return VectorStoreObject.of(await asyncio.to_thread(stores_of(request).get, vector_store_id, client))


async def modify_store(
    vector_store_id: StoreId, request: Request, body: VectorStoreModify, client: str | None
) -> VectorStoreObject:
    stores = stores_of(request)
    record = await asyncio.to_thread(stores.modify, vector_store_id, client, name=body.name, metadata=body.metadata)
    return VectorStoreObject.of(record)


async def delete_store(vector_store_id: StoreId, request: Request, client: str | None) -> VectorStoreDeleted:
    record = await asyncio.to_thread(stores_of(request).delete, vector_store_id, client)
    return VectorStoreDeleted(id=record.id)


async def search_store(
    vector_store_id: StoreId, request: Request, body: SearchRequest, client: str | None, service: Service = Depends(serving)
) -> Response | SearchResultsPage:
    stores = stores_of(request)
    queries = body.queries
    if body.rewrite_query:  # a list is one query, its texts in turn; the store is checked (404) before the call
        await asyncio.to_thread(stores.get, vector_store_id, client)
        try:
            queries = [await service.rewrite_query(request, " ".join(queries), client)]
        except ClientDisconnected:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
    ranking_options = body.ranking_options
    threshold = ranking_options.score_threshold if ranking_options is not None else None
    ranking = (
        service.ranking()
        if ranking_options is None
        else service.ranking(weights=ranking_options.weights, rerank=ranking_options.ranker != "none")
    )
    where = None if body.filters is None else body.filters.to_filter()
    hits = await asyncio.to_thread(
        stores.search, vector_store_id, client, queries, body.max_num_results, threshold, where, ranking
    )
    return SearchResultsPage(search_query=queries, data=[SearchResult.of(hit) for hit in hits])
