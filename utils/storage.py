"""Files on disk that every layer meets: where telerag keeps what it builds (datastores, converted
models, scaled benchmark datastores), a file's checksum, and writing files durably. Here, in the
lowest layer, so that retrieval, the engines and the server resolve, hash and sync them the same way."""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

from telerag.utils.progress import ProgressBar


def user_cache_dir(override: str | Path | None = None) -> Path:
    """The telerag cache: `override`, else $TELERAG_CACHE_DIR (when set and not empty), else
    ~/.cache/telerag."""
    root = override or os.environ.get("TELERAG_CACHE_DIR") or Path.home() / ".cache" / "telerag"
    return Path(root).expanduser()


def file_sha256(path: Path, bar: ProgressBar[None] | None = None) -> str:
    """sha256 of a file's bytes, read in blocks into one reused buffer (nothing else allocated,
    however large the file); `bar` advances by the bytes read."""
    digest = hashlib.sha256()
    buffer = bytearray(4 << 20)
    view = memoryview(buffer)
    with path.open("rb") as handle:
        while size := handle.readinto(buffer):
            digest.update(view[:size])
            if bar is not None:
                bar.update(size)
    return digest.hexdigest()


def fsync_path(path: Path) -> None:
    """Make a file's bytes, or a directory's entries (a rename, a new file), durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_by_rename(target: Path, data: bytes) -> None:
    """`data` into a temporary file beside `target`, synced, then renamed over it and the rename
    synced: a reader finds the old file or the new one, whole, even after a crash."""
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}-{time.monotonic_ns()}")
    try:
        with tmp.open("wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        tmp.rename(target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_path(target.parent)
