"""The datastore: cluster-contiguous vectors, centroids, offsets, passages and a manifest; its
format and the loaded datastore (written by `retrieval.datastore_writer`).

Layout of a datastore directory (`FORMAT_VERSION` 1):

    manifest.json      what it is (embedder, dim, metric, codec, counts) and each file's size and sha256
    centroids.npy      float32 (nlist, dim): the IVF coarse centroids, ordered so that near ones are adjacent
    offsets.npy        int64 (nlist + 1): cluster c is rows offsets[c]:offsets[c+1]
    vectors.npy        codec dtype (n, dim): every vector, cluster after cluster
    ids.npy            optional: int64 (n,), each row's passage id (written by a compaction or retrain, whose
                       rows keep the ids they had); without it a row's id is the row
    documents.jsonl    optional: one document a line, as a live datastore holds it (`retrieval.documents`):
                       written by a compaction or retrain; a build's are read from its passages
    codec.npy          sq8 only: float32 (2, dim), the quantizer's vmin and vdiff
    list_stats.npy     float32 (nlist, 3): each list's radius about its centroid, largest vector norm
                       and least projection on its centroid's direction, the bounds of exact early stop
                       (`experiments.early_stop`; a datastore written before them gets them from
                       `telerag datastore upgrade`)
    passages.jsonl     optional: one {"doc_id","title","text"} per row, in row order
    passages.idx.npy   optional: int64 (n + 1) byte offsets of those lines
    checksums-verified.json  the files above that last matched their checksums, as they lay on disk
                       (`retrieval.checksums`): an open reads only those changed since
    wal-NNNNNN.log     a live datastore's writes since generation NNNNNN was written (`retrieval.wal`,
                       `retrieval.live`); the files above never change
    live.json          the current generation, where a compaction or retrain made one (`retrieval.generations`):
                       its files then lie in gen-NNNNNN/, laid out as above
    live.lock          held (flock) by the process that writes the datastore

A cluster is one slice of `vectors.npy`, so a prefetch is one contiguous copy, and adjacent
clusters can be copied together. A loaded datastore memory-maps these files; a benchmark's
datastore scaled up beyond what a disk holds keeps the same arrays in memory instead.
"""

from __future__ import annotations

import json
import logging
import mmap
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np
from numpy.typing import DTypeLike

from telerag.retrieval.checksums import VERIFIED, check_present, verify
from telerag.retrieval.codecs import Codec
from telerag.retrieval.corpus import Passage, PassageShape
from telerag.retrieval.errors import DatastoreCorruptError, DatastoreError, DatastoreMismatchError, PassageNotFound
from telerag.retrieval.generations import Generation, generation_dir, is_generation_file, read_generation

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
CENTROIDS = "centroids.npy"
OFFSETS = "offsets.npy"
VECTORS = "vectors.npy"
CODEC_PARAMS = "codec.npy"
PASSAGES = "passages.jsonl"
PASSAGE_INDEX = "passages.idx.npy"
LIST_STATS = "list_stats.npy"
IDS = "ids.npy"
DOCUMENTS = "documents.jsonl"
FILES = frozenset(
    {MANIFEST, CENTROIDS, OFFSETS, VECTORS, CODEC_PARAMS, PASSAGES, PASSAGE_INDEX, LIST_STATS, IDS, DOCUMENTS, VERIFIED}
)
LIST_STATS_WIDTH = 3  # radius, largest norm, least projection (`retrieval.early_stop.ListStats`)


@dataclass
class Manifest:
    embedder: str
    dim: int
    nlist: int
    n_vectors: int
    codec: str = Codec.FP32.value
    metric: str = "ip"
    n_documents: int = 0
    passage_words: int | None = None
    passage_overlap: int = 0
    passage_title: bool = False  # the embedded text is the article's title, a newline, the passage
    source: str = ""
    created_at: float = field(default_factory=time.time)
    format_version: int = FORMAT_VERSION
    files: dict[str, dict[str, int | str]] = field(default_factory=dict)

    @property
    def shape(self) -> PassageShape | None:
        """How the passages were cut and what of them was embedded (None: not recorded)."""
        return None if self.passage_words is None else PassageShape(self.passage_words, self.passage_overlap, self.passage_title)

    @classmethod
    def read(cls, path: Path) -> Manifest:
        file = path / MANIFEST
        if not file.is_file():
            raise DatastoreError(f"{path} is not a datastore: {MANIFEST} is missing")
        try:
            data = json.loads(file.read_text(encoding="utf-8"))
            manifest = cls(**data)
        except (json.JSONDecodeError, TypeError) as exc:
            raise DatastoreCorruptError(f"{file}: unreadable manifest ({exc})") from None
        if manifest.format_version != FORMAT_VERSION:
            raise DatastoreMismatchError(
                f"{path}: format version {manifest.format_version}, this server reads version {FORMAT_VERSION}; rebuild it "
                f"with `telerag datastore build --wikipedia --out {path} --overwrite` (or `--corpus FILE` for your own "
                "corpus), or, for the server's default datastore, delete it and restart the server, which builds it on first run"
            )
        return manifest

    def check_embedder(self, where: Path | str, *, embedder: str | None = None, dim: int | None = None) -> None:
        """Refuse a datastore (`where`: its path, for the message) built with another embedder or
        dimension than configured."""
        if embedder is not None and self.embedder != embedder:
            raise DatastoreMismatchError(
                f"{where} was built with embedder {self.embedder!r}, but {embedder!r} is configured; "
                "rebuild the datastore or configure its embedder"
            )
        if dim is not None and self.dim != dim:
            raise DatastoreMismatchError(f"{where} holds {self.dim}-d vectors, but the embedder makes {dim}-d vectors")


def is_datastore_file(name: str) -> bool:
    """Whether `name` is one of the files this project writes into a datastore's directory."""
    return name in FILES or is_generation_file(name)


def _current(path: Path | str) -> tuple[Path, Generation, Path, Manifest]:
    """A datastore's directory, its current generation, where that generation's files lie and their manifest."""
    root = Path(path)
    if not root.is_dir():
        raise DatastoreError(f"no datastore at {root}")
    generation = read_generation(root)
    where = generation_dir(root, generation.number)
    return root, generation, where, Manifest.read(where)


@dataclass(frozen=True)
class Verified:
    """A datastore whose every file was read and matched its checksum."""

    generation: int
    files: int
    bytes_read: int


def verify_datastore(path: Path | str, *, progress: bool = False) -> Verified:
    """Read every byte of the current generation's files against their checksums, whatever earlier
    opens recorded (`telerag datastore verify`: a scrub); raises `DatastoreCorruptError`."""
    _, generation, where, manifest = _current(path)
    check_present(where, manifest.files)
    return Verified(generation.number, len(manifest.files), verify(where, manifest.files, reread=True, progress=progress))


class PassageStore(Protocol):
    """Where a datastore's passages come from, by row (rows are checked by `Datastore.passages`)."""

    def get(self, rows: Sequence[int]) -> list[Passage]: ...

    def close(self) -> None: ...


class MappedPassages:
    """`passages.jsonl` read through a memory map, each row's line found by `passages.idx.npy`."""

    def __init__(self, file: Path, line_offsets: np.ndarray) -> None:
        self.line_offsets = line_offsets
        with file.open("rb") as handle:
            self._map: mmap.mmap | None = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)

    def get(self, rows: Sequence[int]) -> list[Passage]:
        if self._map is None:
            raise DatastoreError("the datastore is closed")
        out = []
        for row in rows:
            start, end = int(self.line_offsets[row]), int(self.line_offsets[row + 1])
            record = json.loads(self._map[start:end])
            out.append(Passage(doc_id=record["doc_id"], title=record["title"], text=record["text"]))
        return out

    def close(self) -> None:
        if self._map is not None:
            self._map.close()
            self._map = None


class Datastore:
    """A datastore's arrays and passages: memory-mapped from its directory (`load`), or held in
    memory (a benchmark's datastore scaled up beyond what a disk holds, `benchmarks.scaled`)."""

    def __init__(
        self,
        manifest: Manifest,
        *,
        centroids: np.ndarray,
        offsets: np.ndarray,
        vectors: np.ndarray,
        codec_params: np.ndarray | None = None,
        list_stats: np.ndarray | None = None,
        ids: np.ndarray | None = None,
        passages: PassageStore | None = None,
        path: Path | None = None,
        root: Path | None = None,
        generation: Generation | None = None,
        where: str | None = None,
    ) -> None:
        """`path`: the directory its files were loaded from (None: in memory); `root`: the
        datastore's directory, whose `generation` they are (default: `path`, generation 0);
        `where`: what messages call it (default: the root). `list_stats`: None for a datastore
        written before they were stored. `ids`: each row's passage id (None: its row)."""
        self.path = path
        self.root = root if root is not None else path
        self.generation = generation or Generation()
        self.where = where or (str(self.root) if self.root is not None else "a datastore in memory")
        self.manifest = manifest
        self.codec = Codec(manifest.codec)
        expected: dict[str, tuple[np.ndarray | None, tuple[int, ...], DTypeLike]] = {
            "centroids": (centroids, (manifest.nlist, manifest.dim), np.float32),
            "offsets": (offsets, (manifest.nlist + 1,), np.int64),
            "vectors": (vectors, (manifest.n_vectors, manifest.dim), self.codec.numpy_dtype),
        }
        if self.codec.has_params:
            expected["codec parameters"] = (codec_params, (2, manifest.dim), np.float32)
        if list_stats is not None:
            expected["list statistics"] = (list_stats, (manifest.nlist, LIST_STATS_WIDTH), np.float32)
        if ids is not None:
            expected["passage ids"] = (ids, (manifest.n_vectors,), np.int64)
        for name, (array, shape, dtype) in expected.items():
            if array is None or array.shape != shape or array.dtype != np.dtype(dtype):
                got = "none" if array is None else f"{array.dtype}{array.shape}"
                raise DatastoreCorruptError(f"{self.where}: {name} are {got}, expected {np.dtype(dtype)}{shape}")
        if offsets[0] != 0 or offsets[-1] != manifest.n_vectors or np.any(np.diff(offsets) < 0):
            raise DatastoreCorruptError(f"{self.where}: offsets do not describe {manifest.n_vectors} vectors")
        self.centroids, self.offsets, self.vectors = centroids, offsets, vectors
        self.codec_params = None if codec_params is None else np.array(codec_params)
        self.list_stats = None if list_stats is None else np.array(list_stats)
        self.ids = None if ids is None else np.asarray(ids)
        self._by_id: tuple[np.ndarray, np.ndarray] | None = None  # (sorted ids, their rows), made on first need
        self._passages = passages

    @classmethod
    def load(
        cls,
        path: Path | str,
        *,
        embedder: str | None = None,
        dim: int | None = None,
        verify_checksums: bool = True,
        progress: bool = False,
    ) -> Datastore:
        """Open a datastore (its current generation: `retrieval.generations`), refusing one built
        for another embedder or dimension, or damaged. Checksums read each file in full once as it
        lies on disk (`retrieval.checksums`; minutes for tens of GB): `progress` shows a bar."""
        root, generation, path, manifest = _current(path)
        manifest.check_embedder(path, embedder=embedder, dim=dim)
        check_present(path, manifest.files)
        if verify_checksums:
            verify(path, manifest.files, progress=progress)
        passages = None
        if PASSAGES in manifest.files:
            line_offsets = _load_array(path, manifest, PASSAGE_INDEX)
            if line_offsets.shape != (manifest.n_vectors + 1,) or line_offsets.dtype != np.int64:
                raise DatastoreCorruptError(
                    f"{path / PASSAGE_INDEX}: {line_offsets.dtype}{line_offsets.shape}, expected int64({manifest.n_vectors + 1},)"
                )
            passages = MappedPassages(path / PASSAGES, line_offsets)
        return cls(
            manifest,
            centroids=_load_array(path, manifest, CENTROIDS),
            offsets=_load_array(path, manifest, OFFSETS),
            vectors=_load_array(path, manifest, VECTORS),
            codec_params=_load_array(path, manifest, CODEC_PARAMS) if Codec(manifest.codec).has_params else None,
            list_stats=_load_array(path, manifest, LIST_STATS) if LIST_STATS in manifest.files else None,
            ids=_load_array(path, manifest, IDS) if IDS in manifest.files else None,
            passages=passages,
            path=path,
            root=root,
            generation=generation,
        )

    @property
    def dim(self) -> int:
        return self.manifest.dim

    @property
    def nlist(self) -> int:
        return self.manifest.nlist

    @property
    def n_vectors(self) -> int:
        return self.manifest.n_vectors

    @property
    def has_passages(self) -> bool:
        return self._passages is not None

    def ids_of(self, rows: np.ndarray) -> np.ndarray:
        """The passage ids of rows."""
        rows = np.asarray(rows, dtype=np.int64)
        return rows if self.ids is None else self.ids[rows]

    def rows_of(self, ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """The rows of passage ids; -1 for an id this datastore does not hold."""
        ids = np.asarray(ids, dtype=np.int64)
        if self.ids is None:
            return np.where((ids >= 0) & (ids < self.n_vectors), ids, -1)
        if self._by_id is None:
            order = np.argsort(self.ids, kind="stable")
            self._by_id = (self.ids[order], order)
        sorted_ids, rows = self._by_id
        if not len(sorted_ids):
            return np.full(ids.shape, -1, dtype=np.int64)
        at = np.minimum(np.searchsorted(sorted_ids, ids), len(sorted_ids) - 1)
        return np.where(sorted_ids[at] == ids, rows[at], -1)

    def passages(self, ids: Sequence[int] | np.ndarray) -> list[Passage]:
        """The passages of the given passage ids."""
        if self._passages is None:
            raise DatastoreError(f"{self.where} holds vectors only, no passages")
        rows = self.rows_of(ids)
        if np.any(rows < 0):
            raise PassageNotFound(f"passage id {int(np.asarray(ids)[rows < 0][0])} is not in {self.where}")
        return self._passages.get(rows.tolist())

    def close(self) -> None:
        if self._passages is not None:
            self._passages.close()


def _load_array(path: Path, manifest: Manifest, name: str) -> np.ndarray:
    """One of the datastore's arrays, memory-mapped (its shape is checked by `Datastore`)."""
    file = path / name
    if name not in manifest.files:
        raise DatastoreCorruptError(f"{file} is not listed in the manifest")
    try:
        return np.load(file, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError) as exc:
        raise DatastoreCorruptError(f"{file}: unreadable ({exc})") from None
