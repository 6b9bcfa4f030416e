"""The on-disk datastore: cluster-contiguous vectors, centroids, offsets, passages and a manifest.

Layout of a datastore directory (`FORMAT_VERSION` 1):

    manifest.json      what it is (embedder, dim, metric, codec, counts) and each file's size and sha256
    centroids.npy      float32 (nlist, dim): the IVF coarse centroids, ordered so that near ones are adjacent
    offsets.npy        int64 (nlist + 1): cluster c is rows offsets[c]:offsets[c+1]
    vectors.npy        codec dtype (n, dim): every vector, cluster after cluster; a vector's id is its row
    codec.npy          sq8 only: float32 (2, dim), the quantizer's vmin and vdiff
    passages.jsonl     optional: one {"doc_id","title","text"} per row, in row order
    passages.idx.npy   optional: int64 (n + 1) byte offsets of those lines

A cluster is one slice of `vectors.npy`, so a prefetch is one contiguous copy, and adjacent
clusters can be copied together. Directories are written under a temporary name and renamed
into place, so a half-built directory is never mistaken for a datastore, and a datastore is
only ever written into a new or empty directory or over one of its own kind: nothing this
project did not create is deleted.
"""

from __future__ import annotations

import glob
import json
import logging
import mmap
import os
import shutil
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np

from telerag.retrieval.codecs import Codec
from telerag.retrieval.corpus import Passage, PassageShape
from telerag.retrieval.errors import DatastoreCorruptError, DatastoreError, DatastoreMismatchError, PassageNotFound
from telerag.retrieval.files import file_sha256
from telerag.retrieval.progress import ProgressBar

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
CENTROIDS = "centroids.npy"
OFFSETS = "offsets.npy"
VECTORS = "vectors.npy"
CODEC_PARAMS = "codec.npy"
PASSAGES = "passages.jsonl"
PASSAGE_INDEX = "passages.idx.npy"
FILES = frozenset({MANIFEST, CENTROIDS, OFFSETS, VECTORS, CODEC_PARAMS, PASSAGES, PASSAGE_INDEX})

WRITE_BLOCK_BYTES = 64 << 20  # vectors are made and written this much at a time


class VectorRows(Protocol):
    """What `write_datastore` reads the vectors from, a block of rows at a time: an array, or
    something that makes each block on demand so the whole set is never in RAM twice."""

    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def dtype(self) -> np.dtype: ...

    def __getitem__(self, rows: slice) -> np.ndarray: ...


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

    def check_embedder(self, path: Path, *, embedder: str | None = None, dim: int | None = None) -> None:
        """Refuse a datastore (at `path`) built with another embedder or dimension than configured."""
        if embedder is not None and self.embedder != embedder:
            raise DatastoreMismatchError(
                f"{path} was built with embedder {self.embedder!r}, but {embedder!r} is configured; "
                "rebuild the datastore or configure its embedder"
            )
        if dim is not None and self.dim != dim:
            raise DatastoreMismatchError(f"{path} holds {self.dim}-d vectors, but the embedder makes {dim}-d vectors")


def _write_rows(path: Path, vectors: VectorRows, progress: bool) -> None:
    """`vectors` into a .npy file, block by block: plain writes, so neither the whole array
    nor a mapping of the file is ever held in memory."""
    n, dim = vectors.shape
    dtype = np.dtype(vectors.dtype)
    step = max(1, WRITE_BLOCK_BYTES // max(1, dim * dtype.itemsize))
    with path.open("wb") as handle:
        header = {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": (n, dim)}
        np.lib.format.write_array_header_1_0(handle, header)
        for start in ProgressBar(range(0, n, step), desc="write vectors", unit="block", disable=not progress):
            block = np.ascontiguousarray(vectors[start : start + step], dtype=dtype)
            if block.shape != (min(step, n - start), dim):
                raise DatastoreError(f"rows {start}:{start + step} of the vectors have shape {block.shape}")
            handle.write(block.data)
            del block  # before the next one is made


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def is_datastore_dir(path: Path) -> bool:
    """Whether `path` is a directory this project wrote: a manifest and nothing but datastore files."""
    if not (path / MANIFEST).is_file():
        return False
    return all(entry.name in FILES for entry in path.iterdir())


def check_target(out_dir: Path, *, overwrite: bool) -> None:
    """Refuse, before any work, to write a datastore where it would delete something this
    project did not create: only a new or empty directory, or (with `overwrite`) a datastore."""
    out_dir = Path(out_dir)
    if not out_dir.exists():
        return
    if not out_dir.is_dir():
        raise DatastoreError(f"{out_dir} is a file, not a directory; refusing to replace it (nothing was changed)")
    if not any(out_dir.iterdir()):
        return
    if not is_datastore_dir(out_dir):
        strangers = sorted(entry.name for entry in out_dir.iterdir() if entry.name not in FILES)
        what = f"{MANIFEST} is missing" if not (out_dir / MANIFEST).is_file() else f"it also holds {', '.join(strangers[:3])}"
        raise DatastoreError(
            f"{out_dir} exists and is not a datastore ({what}); refusing to write into it (nothing was changed): "
            "choose a new or empty directory"
        )
    if not overwrite:
        raise DatastoreError(f"{out_dir} already holds a datastore (pass overwrite, or --overwrite, to replace it)")


def _remove_abandoned_siblings(out_dir: Path) -> None:
    """Delete the temporary directories that builds of `out_dir` killed part-way left beside it
    (named by this module, with the pid of a process that no longer runs)."""
    for sibling in out_dir.parent.glob(f".{glob.escape(out_dir.name)}.*-*-*"):
        kind, _, rest = sibling.name[len(out_dir.name) + 2 :].partition("-")
        pid = rest.partition("-")[0]
        if kind in ("tmp", "old") and pid.isdigit() and not _process_alive(int(pid)) and sibling.is_dir():
            log.info("removing %s, left by a build that did not finish", sibling)
            shutil.rmtree(sibling, ignore_errors=True)


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def write_datastore(
    out_dir: Path,
    *,
    manifest: Manifest,
    centroids: np.ndarray,
    offsets: np.ndarray,
    vectors: VectorRows,
    passages: Iterable[Passage] | None,
    codec_params: np.ndarray | None = None,
    overwrite: bool = False,
    progress: bool = False,
) -> Path:
    """Write a datastore atomically: into a temporary sibling directory, then one rename.

    `vectors` must already be cluster-contiguous and encoded with `manifest.codec` (and its
    `codec_params`, for a codec that has them); they are read and written a block at a time.
    `progress` shows a bar for writing them and for the checksums, which read every byte.
    """
    out_dir = Path(out_dir)
    codec = Codec(manifest.codec)
    if np.dtype(vectors.dtype) != codec.numpy_dtype or tuple(vectors.shape) != (manifest.n_vectors, manifest.dim):
        raise DatastoreError(f"vectors must be {codec.numpy_dtype} of shape ({manifest.n_vectors}, {manifest.dim})")
    if codec.has_params != (codec_params is not None) or (
        codec_params is not None and np.shape(codec_params) != (2, manifest.dim)
    ):
        raise DatastoreError(f"codec {codec.value} needs {'its (2, dim) parameters' if codec.has_params else 'no parameters'}")
    if centroids.shape != (manifest.nlist, manifest.dim) or offsets.shape != (manifest.nlist + 1,):
        raise DatastoreError("centroids / offsets do not match the manifest's nlist and dim")
    if offsets[0] != 0 or offsets[-1] != manifest.n_vectors or np.any(np.diff(offsets) < 0):
        raise DatastoreError("offsets must rise from 0 to n_vectors")
    check_target(out_dir, overwrite=overwrite)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    _remove_abandoned_siblings(out_dir)
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}-{time.monotonic_ns()}"
    tmp.mkdir()
    try:
        np.save(tmp / CENTROIDS, np.ascontiguousarray(centroids, dtype=np.float32))
        np.save(tmp / OFFSETS, np.ascontiguousarray(offsets, dtype=np.int64))
        _write_rows(tmp / VECTORS, vectors, progress)
        if codec_params is not None:
            np.save(tmp / CODEC_PARAMS, np.ascontiguousarray(codec_params, dtype=np.float32))
        if passages is not None:
            line_offsets = [0]
            with (tmp / PASSAGES).open("wb") as handle:
                for passage in passages:
                    line = json.dumps(
                        {"doc_id": passage.doc_id, "title": passage.title, "text": passage.text}, ensure_ascii=False
                    ).encode("utf-8") + b"\n"
                    handle.write(line)
                    line_offsets.append(line_offsets[-1] + len(line))
            if len(line_offsets) - 1 != manifest.n_vectors:
                raise DatastoreError(f"{len(line_offsets) - 1} passages for {manifest.n_vectors} vectors")
            np.save(tmp / PASSAGE_INDEX, np.asarray(line_offsets, dtype=np.int64))
        manifest.files = {}
        files = sorted(tmp.iterdir())
        total = sum(file.stat().st_size for file in files)
        with ProgressBar(total=total, desc="checksum", unit="B", unit_scale=True, disable=not progress) as bar:
            for file in files:
                _fsync(file)
                manifest.files[file.name] = {"bytes": file.stat().st_size, "sha256": file_sha256(file, bar)}
        (tmp / MANIFEST).write_text(json.dumps(asdict(manifest), indent=2), encoding="utf-8")
        _fsync(tmp / MANIFEST)
        check_target(out_dir, overwrite=overwrite)  # again: the directory may have changed during the build
        if out_dir.is_dir() and not any(out_dir.iterdir()):
            out_dir.rmdir()
        if out_dir.exists():  # a datastore, and overwrite was asked for
            old = out_dir.parent / f".{out_dir.name}.old-{os.getpid()}-{time.monotonic_ns()}"
            out_dir.rename(old)
            tmp.rename(out_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


class Datastore:
    """A loaded datastore: arrays memory-mapped from disk, passages read on demand."""

    def __init__(self, path: Path, manifest: Manifest) -> None:
        self.path = path
        self.manifest = manifest
        self.codec = Codec(manifest.codec)
        self.centroids: np.ndarray = self._load_array(CENTROIDS, (manifest.nlist, manifest.dim), np.float32)
        self.offsets: np.ndarray = self._load_array(OFFSETS, (manifest.nlist + 1,), np.int64)
        self.vectors: np.ndarray = self._load_array(
            VECTORS, (manifest.n_vectors, manifest.dim), self.codec.numpy_dtype
        )
        self.codec_params: np.ndarray | None = None
        if self.codec.has_params:
            self.codec_params = np.array(self._load_array(CODEC_PARAMS, (2, manifest.dim), np.float32))
        if self.offsets[0] != 0 or self.offsets[-1] != manifest.n_vectors or np.any(np.diff(self.offsets) < 0):
            raise DatastoreCorruptError(f"{path / OFFSETS}: offsets do not describe {manifest.n_vectors} vectors")
        self._passage_index: np.ndarray | None = None
        self._passage_map: mmap.mmap | None = None
        if PASSAGES in manifest.files:
            self._passage_index = self._load_array(PASSAGE_INDEX, (manifest.n_vectors + 1,), np.int64)
            with (path / PASSAGES).open("rb") as handle:
                self._passage_map = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)

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
        """Open a datastore, refusing one built for another embedder or dimension, or damaged.
        Checksums read every byte (minutes for tens of GB): `progress` shows a bar."""
        path = Path(path)
        if not path.is_dir():
            raise DatastoreError(f"no datastore at {path}")
        manifest = Manifest.read(path)
        manifest.check_embedder(path, embedder=embedder, dim=dim)
        for name, meta in manifest.files.items():
            file = path / name
            if not file.is_file():
                raise DatastoreCorruptError(f"{file} is missing")
            size = file.stat().st_size
            if size != meta["bytes"]:
                raise DatastoreCorruptError(f"{file} is {size} bytes, the manifest says {meta['bytes']} (truncated?)")
        if verify_checksums:
            total = sum(int(meta["bytes"]) for meta in manifest.files.values())
            with ProgressBar(total=total, desc="verify checksums", unit="B", unit_scale=True, disable=not progress) as bar:
                for name, meta in manifest.files.items():
                    if file_sha256(path / name, bar) != meta["sha256"]:
                        raise DatastoreCorruptError(f"{path / name} fails its sha256 checksum")
        return cls(path, manifest)

    def _load_array(self, name: str, shape: tuple[int, ...], dtype: type | np.dtype) -> np.ndarray:
        file = self.path / name
        if name not in self.manifest.files:
            raise DatastoreCorruptError(f"{file} is not listed in the manifest")
        try:
            array = np.load(file, mmap_mode="r", allow_pickle=False)
        except (ValueError, OSError) as exc:
            raise DatastoreCorruptError(f"{file}: unreadable ({exc})") from None
        if array.shape != shape or array.dtype != np.dtype(dtype):
            raise DatastoreCorruptError(f"{file}: {array.dtype}{array.shape}, expected {np.dtype(dtype)}{shape}")
        return array

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
        return self._passage_map is not None

    def passages(self, ids: Sequence[int]) -> list[Passage]:
        """The passages of the given vector ids (rows)."""
        if self._passage_map is None or self._passage_index is None:
            raise DatastoreError(f"{self.path} holds vectors only, no passages")
        out = []
        for row in ids:
            if not 0 <= row < self.n_vectors:
                raise PassageNotFound(f"passage id {row} out of range 0..{self.n_vectors - 1}")
            start, end = int(self._passage_index[row]), int(self._passage_index[row + 1])
            record = json.loads(self._passage_map[start:end])
            out.append(Passage(doc_id=record["doc_id"], title=record["title"], text=record["text"]))
        return out

    def close(self) -> None:
        if self._passage_map is not None:
            self._passage_map.close()
            self._passage_map = None
