"""Files on disk that every layer meets: where telerag keeps what it builds (datastores, converted
models, scaled benchmark datastores), and a file's checksum. Here, in the lowest layer, so that
retrieval, the engines and the server resolve and hash them the same way."""

from __future__ import annotations

import hashlib
import os
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
