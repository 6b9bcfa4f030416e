"""OpenAI's embeddings API: `POST /v1/embeddings`, texts embedded by the datastore's embedder
(for clients that search or cache beside the server). (The endpoint has no docstring: FastAPI
would publish it in the schema.)"""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request

from telerag.server import errors
from telerag.server.auth import Access
from telerag.server.protocols.embeddings import EmbeddingList, EmbeddingRequest
from telerag.server.routes.signature import typed
from telerag.server.service import Service, serving

EMBEDDINGS = "/v1/embeddings"
PATHS = frozenset({EMBEDDINGS})  # its errors speak OpenAI's dialect (middleware.ErrorDialect)


def router(embedding: type[EmbeddingRequest], access: Access) -> APIRouter:
    """The route, with this app's request model and access."""
    routes = APIRouter()
    routes.add_api_route(
        EMBEDDINGS,
        typed(embeddings, body=embedding, client=access.client_parameter()),
        methods=["POST"],
        response_model=EmbeddingList,
        responses=errors.responses(400, *access.api_errors, 413, 422, 503),
        summary="Texts embedded as the datastore's passages are, by its embedder (OpenAI's embeddings)",
    )
    return routes


async def embeddings(
    body: EmbeddingRequest, request: Request, client: str | None, service: Service = Depends(serving)
) -> EmbeddingList:
    embedded = await service.embed(body.model, body.texts, body.dimensions)
    return EmbeddingList.of(embedded, model=body.model, base64=body.encoding_format == "base64")
