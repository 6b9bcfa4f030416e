"""The live datastore itself: `GET /v1/datastore` (its generation, log, lists and the last
compaction or retrain), `POST /v1/datastore/compact` and `POST /v1/datastore/retrain`, each begun
in the background (202) while the datastore serves and takes writes. (The endpoints have no
docstrings: FastAPI would publish them in the schema.)"""

from __future__ import annotations

from fastapi import APIRouter, Depends

from telerag.documents.rebuilds import RebuildKind, Rebuilds
from telerag.server import errors
from telerag.server.auth import Access
from telerag.server.errors import InvalidField
from telerag.server.protocols.documents import DatastoreState, RebuildOut, RetrainRequest, live_info
from telerag.server.service import Service, serving

DATASTORE = "/v1/datastore"


def router(access: Access) -> APIRouter:
    routes = APIRouter(tags=["documents"], dependencies=access.api)
    routes.add_api_route(
        DATASTORE,
        datastore_state,
        methods=["GET"],
        response_model=DatastoreState,
        responses=errors.responses(*access.api_errors, 501, 503),
        summary="The datastore's generation, log and lists, and its last compaction or retrain",
    )
    routes.add_api_route(
        DATASTORE + "/compact",
        compact,
        methods=["POST"],
        status_code=202,
        response_model=RebuildOut,
        responses=errors.responses(*access.api_errors, 409, 501, 503),
        summary="Fold the documents written since into new files, in the background: no result changes",
    )
    routes.add_api_route(
        DATASTORE + "/retrain",
        retrain,
        methods=["POST"],
        status_code=202,
        response_model=RebuildOut,
        responses=errors.responses(400, *access.api_errors, 409, 422, 501, 503),
        summary="New centroids, every passage assigned again, in the background: results change",
    )
    return routes


def rebuilds(service: Service = Depends(serving)) -> Rebuilds:
    return service.rebuilds()


async def datastore_state(service: Service = Depends(serving), rebuilds: Rebuilds = Depends(rebuilds)) -> DatastoreState:
    last = rebuilds.last
    return DatastoreState(
        live=live_info(service.documents(), service.ingestion_progress()), rebuild=None if last is None else RebuildOut.of(last)
    )


async def compact(rebuilds: Rebuilds = Depends(rebuilds)) -> RebuildOut:
    return RebuildOut.of(rebuilds.start(RebuildKind.COMPACT))


async def retrain(
    body: RetrainRequest | None = None, service: Service = Depends(serving), rebuilds: Rebuilds = Depends(rebuilds)
) -> RebuildOut:
    nlist = None if body is None else body.nlist
    if nlist is not None and nlist > (passages := service.documents().stats().passages):
        raise InvalidField("nlist", f"nlist: at most the datastore's passages ({passages}), one list each")
    return RebuildOut.of(rebuilds.start(RebuildKind.RETRAIN, nlist=nlist))
