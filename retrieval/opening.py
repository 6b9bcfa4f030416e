"""Opening a datastore to search: loaded and checked against the embedder that will search it
(`open_datastore`), and live, every write since it was written replayed, writable by the one
process that holds it (`open_live`). Building one, and taking an ingestion that has not ended to
its end, is the pipelines' (`pipelines.datastores`, `documents.ingestion`): they embed."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from telerag.retrieval.corpus import WIKIPEDIA_SOURCE
from telerag.retrieval.datastore import LIST_STATS, Datastore, Manifest
from telerag.retrieval.datastore_writer import add_list_stats
from telerag.retrieval.early_stop import require_list_stats
from telerag.retrieval.errors import DatastoreBusy
from telerag.retrieval.live import LiveDatastore

log = logging.getLogger(__name__)


def open_datastore(
    path: Path,
    *,
    embedder: str,
    dim: int,
    verify_checksums: bool = True,
    early_stop: bool = False,
    own_wikipedia: bool = False,
    on_step: Callable[[str], None] = lambda step: None,
) -> Datastore:
    """The datastore at `path`, refused (`DatastoreMismatchError`) if it was built with another
    embedder than `embedder` or holds vectors of another dimension than `dim`, and its files
    checked. `on_step` hears each step begin.

    With `early_stop`, a datastore without the list statistics early stop needs (written
    before they were stored) is refused in one line naming `telerag datastore upgrade`; except
    the built-in Wikipedia one where `own_wikipedia` makes it the server's own (a cache the
    embedded default built on an older telerag): that one is upgraded here, saying so, as the
    server would have built it here (`add_list_stats`: one new file, nothing else changed)."""
    if early_stop and own_wikipedia:
        manifest = Manifest.read(path)
        if LIST_STATS not in manifest.files and manifest.source == WIKIPEDIA_SOURCE:
            on_step("adding list statistics to the datastore (upgrade)")
            log.info(
                "upgrading the Wikipedia datastore at %s, built by an older telerag: adding the list statistics that "
                "experiments.early_stop needs (list_stats.npy; as `telerag datastore upgrade %s` does)",
                path,
                path,
            )
            add_list_stats(path, verify_checksums=verify_checksums, progress=True)
    on_step("checking datastore")
    datastore = Datastore.load(path, embedder=embedder, dim=dim, verify_checksums=verify_checksums, progress=True)
    if early_stop:
        require_list_stats(datastore)
    return datastore


def open_live(datastore: Datastore, *, writable: bool) -> LiveDatastore:
    """`datastore` with every write made to it since it was written (replayed from its log); with
    `writable`, open for writing here unless another process holds it or its directory cannot be
    written, in which case it is read-only here, as one warning says."""
    if writable and datastore.path is not None:
        try:
            return LiveDatastore(datastore, writable=True)
        except DatastoreBusy as exc:
            log.warning("%s; it is read-only here: documents cannot be written through this process", exc)
        except OSError as exc:
            log.warning(
                "%s cannot be written (%s); it is read-only here: no documents can be written to it", datastore.where, exc
            )
    return LiveDatastore(datastore)
