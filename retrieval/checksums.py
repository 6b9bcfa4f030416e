"""A datastore's files against the sizes and checksums its manifest records.

Reading every byte at each start-up cost 69 of a server's 94 s at 21M vectors (43 GB), so a file
that passed is recorded beside it (`VERIFIED`) with what identifies its bytes on disk without
reading them: inode, size, modification and change times. An open reads again only the files
whose record no longer matches: a copy or a move to another filesystem (a new inode), any write
(a new change time, which no one can set back). `reread` reads every byte whatever was recorded
(`telerag datastore verify`). The record only ever spares a read: a file changed within
`RACY_NS` of its recording is not recorded (a filesystem's clock ticks every few ms, so a write
in the same tick would keep its times), and where the directory cannot be written every open
reads every file, as before.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

from telerag.retrieval.errors import DatastoreCorruptError
from telerag.utils.progress import ProgressBar
from telerag.utils.storage import file_sha256, write_by_rename

log = logging.getLogger(__name__)

VERIFIED = "checksums-verified.json"
RACY_NS = 2_000_000_000

FileList = Mapping[str, Mapping[str, int | str]]  # a manifest's files: name -> {"bytes", "sha256"}


@dataclass(frozen=True)
class OnDisk:
    """What tells a file's bytes apart on disk without reading them: any write to the file moves
    its change time, a copy makes a new inode."""

    size: int
    inode: int
    mtime_ns: int
    ctime_ns: int

    @classmethod
    def of(cls, path: Path) -> OnDisk:
        stat = path.stat()
        return cls(stat.st_size, stat.st_ino, stat.st_mtime_ns, stat.st_ctime_ns)

    def settled(self, now_ns: int) -> bool:
        """Whether a later write would surely show in its times (none came within `RACY_NS`)."""
        return max(self.mtime_ns, self.ctime_ns) < now_ns - RACY_NS


@dataclass(frozen=True)
class Passed:
    """A file that matched its checksum, as it lay on disk then."""

    sha256: str
    on_disk: OnDisk


def check_present(path: Path, files: FileList) -> None:
    """Refuse a datastore one of whose files is missing or not the size its manifest says (cheap:
    no byte read)."""
    for name, meta in files.items():
        file = path / name
        if not file.is_file():
            raise DatastoreCorruptError(f"{file} is missing")
        size = file.stat().st_size
        if size != meta["bytes"]:
            raise DatastoreCorruptError(f"{file} is {size} bytes, the manifest says {meta['bytes']} (truncated?)")


def verify(path: Path, files: FileList, *, reread: bool = False, progress: bool = False) -> int:
    """Check `files` in `path` against their checksums, reading each one not recorded as passed
    as it lies now (every one with `reread`), and record those that pass; raises
    `DatastoreCorruptError` at the first that fails. Returns the bytes read."""
    recorded = {} if reread else read_record(path)
    passed: dict[str, Passed] = {}
    unread: list[tuple[str, str, OnDisk]] = []
    for name, meta in files.items():
        sha256, on_disk = str(meta["sha256"]), OnDisk.of(path / name)
        if recorded.get(name) == Passed(sha256, on_disk):
            passed[name] = recorded[name]
        else:
            unread.append((name, sha256, on_disk))
    total = sum(on_disk.size for _, _, on_disk in unread)
    with ProgressBar[None](total=total, desc="verify checksums", unit="B", unit_scale=True, disable=not progress) as bar:
        for name, sha256, before in unread:
            if file_sha256(path / name, bar) != sha256:
                raise DatastoreCorruptError(f"{path / name} fails its sha256 checksum")
            if OnDisk.of(path / name) == before:  # else it changed while read: nothing to record
                passed[name] = Passed(sha256, before)
    if unread or set(recorded) != set(passed):
        record(path, passed)
    return total


def read_record(path: Path) -> dict[str, Passed]:
    """The files recorded in `path` as passed (none where no record is, or one that cannot be read)."""
    file = path / VERIFIED
    if not file.is_file():
        return {}
    try:
        entries = json.loads(file.read_text(encoding="utf-8"))["files"]
        return {name: Passed(entry["sha256"], OnDisk(**entry["on_disk"])) for name, entry in entries.items()}
    except (ValueError, KeyError, TypeError) as exc:
        log.warning("%s is unreadable (%s): every file is read against its checksum", file, exc)
        return {}


def record(path: Path, passed: Mapping[str, Passed]) -> None:
    """Record in `path` the files that passed and have settled (`OnDisk.settled`); where it cannot
    be written (a read-only mount), say so once and go on: the next open reads them again."""
    now = time.time_ns()
    entries = {name: asdict(one) for name, one in sorted(passed.items()) if one.on_disk.settled(now)}
    try:
        write_by_rename(path / VERIFIED, json.dumps({"files": entries}, indent=1).encode("utf-8"))
    except OSError as exc:
        log.info("%s: could not record which files passed their checksums (%s); the next start reads them again", path, exc)
