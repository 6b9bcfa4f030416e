"""The datastore's one writer on a Ray cluster: the ingress.

Every node mounts the datastore's directory (the volume of deploy/rayservice.yaml; here, the same
path). The ingress holds it for writing (`retrieval.live`: its lock, its write-ahead log) and
serves `/v1/documents` as one process does: a write is acknowledged once its record is synced to
the volume. The inference replicas open it read-only and follow the log (each request's snapshot
has every write acknowledged before it began, whichever replica runs it), and the retrieval
tier's shards load each generation the writer switches to when a search names it
(`server.ray_serve.tier`). A restarted ingress opens the log again, its torn tail (a write cut short,
never acknowledged) cut off; nothing acknowledged is lost.

Passages are embedded here by the ingress's embedder (the one that places questions), a chunk
at a time so that a question's placement waits for one chunk at most. A retrain's new centroids
reach the placement too (`QuestionPlacer.centroids`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from telerag.config.settings import Settings
from telerag.documents.rebuilds import Rebuilds
from telerag.documents.writer import DocumentWriter
from telerag.retrieval.datastore import Datastore
from telerag.retrieval.live import LiveDatastore
from telerag.retrieval.opening import open_live
from telerag.server.process.runtime import datastore_writes
from telerag.server.ray_serve.replicas import QuestionPlacer

log = logging.getLogger(__name__)

EMBED_CHUNK = 32  # passages embedded at once: a question placed meanwhile waits for one chunk


@dataclass
class IngressWrites:
    """The ingress's writer of the datastore, its compactions and retrains."""

    live: LiveDatastore
    documents: DocumentWriter
    rebuilds: Rebuilds

    @classmethod
    def open(cls, settings: Settings, placer: QuestionPlacer) -> IngressWrites:
        """The configured datastore held for writing here (read-only, as one warning says, where
        another process holds it: then every write is refused)."""
        embedder = placer.embedder
        path = settings.retrieval.datastore.expanduser()
        datastore = Datastore.load(path, embedder=embedder.name, dim=embedder.dim, verify_checksums=False)
        live = open_live(datastore, writable=True)

        def embed_passages(texts: Sequence[str]) -> np.ndarray:
            chunks = [placer.embed(texts[i : i + EMBED_CHUNK]) for i in range(0, len(texts), EMBED_CHUNK)]
            return np.concatenate(chunks) if chunks else np.zeros((0, embedder.dim), np.float32)

        documents, rebuilds = datastore_writes(live, embed_passages, settings)
        rebuilds.on_done = lambda _: placer.follow(live.datastore)
        log.info("the ingress writes %s (LSN %d, generation %d)", live.where, live.snapshot().lsn, live.generation)
        return cls(live, documents, rebuilds)

    def close(self) -> None:
        """The writes queued finish, a rebuild under way ends, then the log and the lock let go."""
        self.documents.close()
        self.rebuilds.join()
        self.live.close()
