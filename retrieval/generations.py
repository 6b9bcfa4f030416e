"""A live datastore's generations on disk: which one is current, where its files and its log lie.

A datastore directory holds generation 0, the files a build wrote (`retrieval.datastore`), and
`wal-000000.log`, the writes made since. A compaction or a retrain writes generation N's files into
`gen-00000N/` and its log `wal-00000N.log` (the writes made while it was built), then renames
`live.json` into place, naming N, the last write its files include and the next passage id to
hand out: that rename is the switch, so a reader finds the old generation or the new one, whole.
Whatever a switch left of older generations (or a build killed before its switch) is the
project's own and is removed when the datastore is next opened for writing; generation 0's files
are never removed.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path

from telerag.retrieval.errors import DatastoreCorruptError
from telerag.utils.storage import write_by_rename

POINTER = "live.json"
LOCK = "live.lock"  # held (flock) by the process that writes the datastore
INGESTION = "ingestion.json"  # how far a corpus's ingestion into the datastore is (`documents.ingestion`)
_GENERATION_DIR = re.compile(r"gen-(\d{6})")
_WAL = re.compile(r"wal-(\d{6})\.log")


@dataclass(frozen=True)
class Generation:
    """The current generation, as `live.json` names it (generation 0 without one)."""

    number: int = 0
    lsn: int = 0  # the last write its files include
    next_id: int | None = None  # the next passage id to hand out (None: one past the generation's largest)


def wal_name(number: int) -> str:
    """The log of the writes made since generation `number` was written."""
    return f"wal-{number:06d}.log"


def generation_dir(root: Path, number: int) -> Path:
    """Where generation `number`'s files lie: the datastore directory itself for 0."""
    return root if number == 0 else root / f"gen-{number:06d}"


def is_generation_file(name: str) -> bool:
    """Whether `name`, in a datastore directory, is one of the files or folders of its generations."""
    return name in (POINTER, LOCK, INGESTION) or bool(_GENERATION_DIR.fullmatch(name) or _WAL.fullmatch(name))


def read_generation(root: Path) -> Generation:
    """The current generation of the datastore at `root`."""
    pointer = root / POINTER
    if not pointer.is_file():
        return Generation()
    try:
        return Generation(**json.loads(pointer.read_text(encoding="utf-8")))
    except (ValueError, TypeError) as exc:
        raise DatastoreCorruptError(f"{pointer} is unreadable ({exc})") from None


def switch_to(root: Path, generation: Generation) -> None:
    """Make `generation` the current one: `live.json` written beside, synced, renamed into place."""
    write_by_rename(root / POINTER, json.dumps(asdict(generation)).encode("utf-8"))


def stale(root: Path, current: int) -> list[Path]:
    """The generations' folders and logs in `root` that are not generation `current`'s (generation
    0's files are the directory's own, and never among them)."""
    out = []
    for entry in root.iterdir():
        match = _GENERATION_DIR.fullmatch(entry.name) or _WAL.fullmatch(entry.name)
        if match is not None and int(match.group(1)) != current:
            out.append(entry)
    return out
