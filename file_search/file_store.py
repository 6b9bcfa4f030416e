"""Files uploaded through OpenAI's Files API (`/v1/files`), kept as they came, each its owner's.

A file is two files in the store's directory: `<id>.bin` (the bytes) and `<id>.json` (what the
API says of it), each written to a temporary name, synced and renamed, the description last: a
file is there once its description is, so an upload cut short leaves at most a `.bin` (or a
temporary file) that nothing names, removed at the next open. Each file belongs to the API key
that uploaded it (`owner`, a fingerprint of the key; None on a server without keys): another key
never sees it, as if it did not exist.
"""

from __future__ import annotations

import json
import secrets
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from telerag.documents.conversion import FileFormat, file_format
from telerag.file_search.errors import FileNotFound, FilesTooLarge
from telerag.utils.storage import fsync_path, write_by_rename

PURPOSES = ("assistants", "user_data")  # OpenAI's purposes of files for file search; the rest are not served


@dataclass(frozen=True)
class StoredFile:
    id: str
    filename: str
    bytes: int
    created_ns: int  # Unix nanoseconds: the order of files made in one second
    purpose: str
    format: FileFormat
    owner: str | None

    @property
    def created_at(self) -> int:
        """Unix seconds, as OpenAI's API says it."""
        return self.created_ns // 1_000_000_000


class FileStore:
    """The uploaded files under `root`: each at most `max_bytes`, at most `max_bytes_per_owner`
    of them in all per owner."""

    def __init__(self, root: Path, *, max_bytes: int, max_bytes_per_owner: int) -> None:
        self.root = Path(root)
        self.max_bytes, self.max_bytes_per_owner = max_bytes, max_bytes_per_owner
        self._lock = threading.Lock()  # the description index, and each owner's bytes
        self._files: dict[str, StoredFile] = {}
        self._opened = False

    def _open(self) -> None:
        """Read the descriptions (once, at first use), and remove what an upload cut short left."""
        if self._opened:
            return
        self.root.mkdir(parents=True, exist_ok=True)
        for path in self.root.glob("*.json"):
            described = json.loads(path.read_text(encoding="utf-8"))
            self._files[described["id"]] = StoredFile(**{**described, "format": FileFormat(described["format"])})
        for path in self.root.iterdir():
            unnamed = path.suffix == ".bin" and path.stem not in self._files
            if unnamed or path.name.startswith("."):  # `write_by_rename`'s temporary files
                path.unlink()
        self._opened = True

    def add(self, data: bytes, filename: str, purpose: str, owner: str | None, content_type: str | None = None) -> StoredFile:
        """Keep `data` as a new file (its format told by name, else type, else content: `UnsupportedFile`
        names it), durable once this returns."""
        fmt = file_format(filename, content_type, data)
        if len(data) > self.max_bytes:
            raise FilesTooLarge(f"the file is {len(data)} bytes, over files.max_bytes ({self.max_bytes})")
        with self._lock:
            self._open()
            held = sum(f.bytes for f in self._files.values() if f.owner == owner)
            if held + len(data) > self.max_bytes_per_owner:
                raise FilesTooLarge(
                    f"this key's files would hold {held + len(data)} bytes, over files.max_bytes_per_key "
                    f"({self.max_bytes_per_owner}): delete some first"
                )
            stored = StoredFile(f"file-{secrets.token_hex(12)}", filename, len(data), time.time_ns(), purpose, fmt, owner)
            write_by_rename(self.root / f"{stored.id}.bin", data)
            write_by_rename(self.root / f"{stored.id}.json", json.dumps(asdict(stored)).encode("utf-8"))
            self._files[stored.id] = stored
        return stored

    def get(self, file_id: str, owner: str | None) -> StoredFile:
        with self._lock:
            self._open()
            stored = self._files.get(file_id)
        if stored is None or stored.owner != owner:
            raise FileNotFound(f"no file {file_id!r}")
        return stored

    def content(self, file_id: str, owner: str | None) -> bytes:
        stored = self.get(file_id, owner)
        return (self.root / f"{stored.id}.bin").read_bytes()

    def files(self, owner: str | None, *, purpose: str | None = None) -> list[StoredFile]:
        """The owner's files, oldest first (by creation, then id)."""
        with self._lock:
            self._open()
            held = [f for f in self._files.values() if f.owner == owner and (purpose is None or f.purpose == purpose)]
        return sorted(held, key=lambda f: (f.created_ns, f.id))

    def delete(self, file_id: str, owner: str | None) -> StoredFile:
        """Gone once this returns: its description first (so it is never half there), then its bytes."""
        stored = self.get(file_id, owner)
        with self._lock:
            if self._files.pop(stored.id, None) is None:
                raise FileNotFound(f"no file {file_id!r}")  # deleted by another request meanwhile
            (self.root / f"{stored.id}.json").unlink()
            fsync_path(self.root)
            (self.root / f"{stored.id}.bin").unlink(missing_ok=True)
        return stored


def page(files: list[StoredFile], *, after: str | None, limit: int, newest_first: bool) -> tuple[list[StoredFile], bool]:
    """One page of `files` (oldest first) in the order asked, starting after the file `after`
    (an id not among them: the first page), and whether more follow."""
    ordered = list(reversed(files)) if newest_first else files
    ids = [f.id for f in ordered]
    start = ids.index(after) + 1 if after in ids else 0
    chosen = ordered[start : start + limit + 1]
    return chosen[:limit], len(chosen) > limit
