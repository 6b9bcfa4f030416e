"""Writing a datastore (the format is `retrieval.datastore`'s): atomically, into a temporary
sibling directory renamed into place, so a half-built directory is never mistaken for a
datastore; and only into a new or empty directory or over one of its own kind, so nothing this
project did not create is ever deleted.
"""

from __future__ import annotations

import glob
import io
import json
import logging
import os
import shutil
import time
from collections.abc import Iterable, Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Protocol

import numpy as np

from telerag.retrieval.checksums import OnDisk, Passed, record
from telerag.retrieval.codecs import Codec
from telerag.retrieval.corpus import Passage
from telerag.retrieval.datastore import (
    CENTROIDS,
    CODEC_PARAMS,
    DOCUMENTS,
    FILES,
    IDS,
    LIST_STATS,
    MANIFEST,
    OFFSETS,
    PASSAGE_INDEX,
    PASSAGES,
    VECTORS,
    Datastore,
    Manifest,
    is_datastore_file,
)
from telerag.retrieval.documents import DocumentEntry
from telerag.retrieval.early_stop import ListStats
from telerag.retrieval.errors import DatastoreError
from telerag.utils.progress import ProgressBar
from telerag.utils.storage import file_sha256, fsync_path, write_by_rename

log = logging.getLogger(__name__)

WRITE_BLOCK_BYTES = 64 << 20  # vectors are made and written this much at a time
PASSAGE_BAR_STEP = 4096  # passages written between two updates of the progress bar


class VectorRows(Protocol):
    """What `write_datastore` reads the vectors from, a block of rows at a time: an array, or
    something that makes each block on demand so the whole set is never in RAM twice."""

    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def dtype(self) -> np.dtype: ...

    def __getitem__(self, rows: slice) -> np.ndarray: ...


def _write_rows(path: Path, vectors: VectorRows, stats: ListStats, progress: bool) -> np.ndarray:
    """`vectors` into a .npy file, block by block: plain writes, so neither the whole array
    nor a mapping of the file is ever held in memory. Returns the `stats` of the blocks."""
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
            stats.add(start, block)
            del block  # before the next one is made
    return stats.result()


def is_datastore_dir(path: Path) -> bool:
    """Whether `path` is a directory this project wrote: a manifest and nothing but datastore files."""
    if not (path / MANIFEST).is_file():
        return False
    return all(is_datastore_file(entry.name) for entry in path.iterdir())


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
        strangers = sorted(entry.name for entry in out_dir.iterdir() if not is_datastore_file(entry.name))
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
    ids: np.ndarray | None = None,
    documents: Iterable[DocumentEntry] | None = None,
    extra_files: Mapping[str, bytes] | None = None,
    overwrite: bool = False,
    progress: bool = False,
) -> Path:
    """Write a datastore atomically: into a temporary sibling directory, then one rename.

    `vectors` must already be cluster-contiguous and encoded with `manifest.codec` (and its
    `codec_params`, for a codec that has them); they are read and written a block at a time.
    `ids`: each row's passage id (`ids.npy`; None: a row's id is its row); `documents`: the
    documents a live datastore holds (`documents.jsonl`; None: they are read from the passages);
    `extra_files`: files of the datastore's own that change after it is written (an ingestion's
    record), written with the rest but not in its manifest. `progress` shows a bar for writing them
    and for the checksums, which read every byte.
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
    extra_files = extra_files or {}
    if any(name in FILES or not is_datastore_file(name) for name in extra_files):
        raise DatastoreError(f"not a datastore's own file beside its generation's: {sorted(extra_files)}")
    check_target(out_dir, overwrite=overwrite)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    _remove_abandoned_siblings(out_dir)
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}-{time.monotonic_ns()}"
    tmp.mkdir()
    try:
        np.save(tmp / CENTROIDS, np.ascontiguousarray(centroids, dtype=np.float32))
        np.save(tmp / OFFSETS, np.ascontiguousarray(offsets, dtype=np.int64))
        stats = _write_rows(tmp / VECTORS, vectors, ListStats(centroids, offsets, codec, codec_params), progress)
        np.save(tmp / LIST_STATS, stats)
        if codec_params is not None:
            np.save(tmp / CODEC_PARAMS, np.ascontiguousarray(codec_params, dtype=np.float32))
        _write_passages(tmp, manifest, passages, ids, documents, progress)
        hashed = _synced_and_hashed(tmp, progress)
        manifest.files = {name: {"bytes": one.on_disk.size, "sha256": one.sha256} for name, one in hashed.items()}
        (tmp / MANIFEST).write_text(json.dumps(asdict(manifest), indent=2), encoding="utf-8")
        fsync_path(tmp / MANIFEST)
        record(tmp, hashed)  # what was just read back need not be read again at the first open
        for name, data in extra_files.items():
            (tmp / name).write_bytes(data)
            fsync_path(tmp / name)
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


def _synced_and_hashed(path: Path, progress: bool) -> dict[str, Passed]:
    """Each file in `path` made durable, then read back for its checksum."""
    files = sorted(path.iterdir())
    hashed: dict[str, Passed] = {}
    with ProgressBar[None](total=sum(file.stat().st_size for file in files), desc="checksum", unit="B", unit_scale=True,
                           disable=not progress) as bar:  # fmt: skip
        for file in files:
            fsync_path(file)
            on_disk = OnDisk.of(file)
            hashed[file.name] = Passed(file_sha256(file, bar), on_disk)
    return hashed


def _write_passages(
    tmp: Path,
    manifest: Manifest,
    passages: Iterable[Passage] | None,
    ids: np.ndarray | None,
    documents: Iterable[DocumentEntry] | None,
    progress: bool,
) -> None:
    """What a datastore holds beside its vectors: the passages (a JSON line each, and where each
    line starts: an int64 a passage, where a list of Python ints was 36 bytes), their ids and its
    documents, where it has them."""
    if ids is not None:
        if np.shape(ids) != (manifest.n_vectors,) or len(np.unique(ids)) != manifest.n_vectors:
            raise DatastoreError(f"ids must be {manifest.n_vectors} distinct passage ids, one a row")
        np.save(tmp / IDS, np.ascontiguousarray(ids, dtype=np.int64))
    if documents is not None:
        with (tmp / DOCUMENTS).open("w", encoding="utf-8") as handle:
            for entry in documents:
                handle.write(json.dumps(entry.to_json(), ensure_ascii=False) + "\n")
    if passages is None:
        return
    n = manifest.n_vectors
    line_offsets = np.zeros(n + 1, dtype=np.int64)
    written = 0
    with (
        (tmp / PASSAGES).open("wb") as handle,
        ProgressBar[None](total=n, desc="write passages", unit="passage", unit_scale=True, disable=not progress) as bar,
    ):
        for passage in passages:
            if written == n:
                raise DatastoreError(f"more passages than the {n} vectors")
            record = {"doc_id": passage.doc_id, "title": passage.title, "text": passage.text}
            line = json.dumps(record, ensure_ascii=False).encode("utf-8") + b"\n"
            handle.write(line)
            line_offsets[written + 1] = line_offsets[written] + len(line)
            written += 1
            if written % PASSAGE_BAR_STEP == 0:
                bar.update(PASSAGE_BAR_STEP)
        bar.update(written % PASSAGE_BAR_STEP)
    if written != n:
        raise DatastoreError(f"{written} passages for {n} vectors")
    np.save(tmp / PASSAGE_INDEX, line_offsets)


def add_list_stats(path: Path, *, verify_checksums: bool = True, progress: bool = False) -> bool:
    """Upgrade a datastore written before list statistics were stored: compute them from its
    vectors (after checking its files, unless `verify_checksums` is false) and write them as a
    new file beside the others, `list_stats.npy`, then the manifest that lists it; each into a
    temporary file renamed into place, so a reader finds the datastore as it was or upgraded,
    whole. Nothing else is rewritten or deleted. Returns False, changing nothing, when it has
    them already."""
    path = Path(path).expanduser()
    manifest = Manifest.read(path)
    if LIST_STATS in manifest.files:
        return False
    datastore = Datastore.load(path, verify_checksums=verify_checksums, progress=progress)
    try:
        with ProgressBar[None](total=datastore.n_vectors, desc="list statistics", unit="row", disable=not progress) as bar:
            stats = ListStats.of(
                datastore.centroids,
                datastore.offsets,
                datastore.vectors,
                datastore.codec,
                datastore.codec_params,
                on_block=bar.update,
            )
    finally:
        datastore.close()
    target = path / LIST_STATS
    # one not in the manifest was left by an upgrade stopped between its two renames (its bytes are
    # what this one would write), or is not ours
    if target.exists() and (not target.is_file() or target.read_bytes() != _npy_bytes(stats)):
        raise DatastoreError(
            f"{target} exists but {MANIFEST} does not list it; refusing to replace a file this command did not "
            "write (nothing was changed): move it away and run the upgrade again"
        )
    try:
        if not target.exists():
            write_by_rename(target, _npy_bytes(stats))
        manifest.files[LIST_STATS] = {"bytes": target.stat().st_size, "sha256": file_sha256(target)}
        write_by_rename(path / MANIFEST, json.dumps(asdict(manifest), indent=2).encode("utf-8"))
    except OSError as exc:
        raise DatastoreError(
            f"could not add {LIST_STATS} to {path} ({exc}); it reads as before: run the upgrade again where it can be written"
        ) from exc
    return True


def _npy_bytes(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()
