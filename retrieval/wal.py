"""The write-ahead log of a live datastore: every write since the datastore's files were written,
appended and synced before it is acknowledged, and replayed when the datastore is opened.

A log is a header and then records, each `length, lsn, crc32` (little-endian u32, u64, u32) and
`length` bytes of payload; the checksum covers the sequence number and the payload. Sequence
numbers (LSNs) rise by one from the first record. Appending writes whole records with one
`os.write` each and never syncs; `sync` makes every record appended before it durable, so that a
writer appends a batch of records and syncs once (group commit).

A process killed while appending leaves a torn tail: a last record cut short or failing its
checksum with nothing after it. Reading stops there; the writer (who holds the datastore's lock)
cuts it off with one log line. A record failing its checksum with whole records after it is
damage, not a tear: it is refused, never skipped, since what follows was acknowledged.
"""

from __future__ import annotations

import logging
import os
import struct
import threading
import zlib
from dataclasses import dataclass
from pathlib import Path

from telerag.retrieval.errors import DatastoreCorruptError, DatastoreError
from telerag.utils.storage import fsync_path

log = logging.getLogger(__name__)

MAGIC = b"TELERAG-WAL\x00\x00\x00\x00\x01"  # 16 bytes: the format's name and version 1
RECORD_HEADER = struct.Struct("<IQI")  # payload length, lsn, crc32 of (lsn, payload)
MAX_RECORD_BYTES = 1 << 31  # a length past this is a torn or damaged header, never a record


@dataclass(frozen=True)
class LogRecord:
    lsn: int
    payload: bytes


def _checksum(lsn: int, payload: bytes) -> int:
    return zlib.crc32(payload, zlib.crc32(struct.pack("<Q", lsn)))


def encode_record(lsn: int, payload: bytes) -> bytes:
    return RECORD_HEADER.pack(len(payload), lsn, _checksum(lsn, payload)) + payload


@dataclass(frozen=True)
class LogContents:
    """What reading a log found: its whole records, and where they end (a torn tail, if any,
    lies between `end` and the file's size)."""

    records: list[LogRecord]
    end: int
    size: int

    @property
    def torn_bytes(self) -> int:
        return self.size - self.end


def read_log(path: Path, *, start: int = 0, after_lsn: int | None = None) -> LogContents:
    """Every whole record of the log at `path` (none if there is no file), in order; from byte
    `start` on (where a reader's earlier read ended: a record's first byte), the first record
    read there following `after_lsn`."""
    if not path.exists():
        return LogContents([], 0, 0)
    with open(path, "rb") as file:
        if start:
            file.seek(start)
        data = file.read()
    if not start:
        if len(data) < len(MAGIC):
            # a log whose header was being written when the process died: nothing was ever in it
            return LogContents([], 0, len(data))
        if data[: len(MAGIC)] != MAGIC:
            raise DatastoreCorruptError(f"{path} is not a telerag write-ahead log (or is of another version)")
    records: list[LogRecord] = []
    offset = 0 if start else len(MAGIC)
    while offset < len(data):
        if len(data) - offset < RECORD_HEADER.size:
            break  # a header cut short: torn (or being appended)
        length, lsn, crc = RECORD_HEADER.unpack_from(data, offset)
        end = offset + RECORD_HEADER.size + length
        if length > MAX_RECORD_BYTES or end > len(data):
            break  # runs past the end: torn
        payload = data[offset + RECORD_HEADER.size : end]
        if _checksum(lsn, payload) != crc:
            if end < len(data):
                raise DatastoreCorruptError(
                    f"{path}: the record at byte {start + offset} fails its checksum and {len(data) - end} bytes follow "
                    "it; the log is damaged (not torn by a crash), and what follows was acknowledged: restore it from a backup"
                )
            break  # the last record, half written: torn
        expected = records[-1].lsn + 1 if records else None if after_lsn is None else after_lsn + 1
        if expected is not None and lsn != expected:
            raise DatastoreCorruptError(f"{path}: record at byte {start + offset} has LSN {lsn}, expected {expected}")
        records.append(LogRecord(lsn, payload))
        offset = end
    return LogContents(records, start + offset, start + len(data))


class WriteAheadLog:
    """A log open for appending (by the one process holding the datastore's lock)."""

    def __init__(self, path: Path, *, next_lsn: int) -> None:
        """Open (or create) the log at `path`, its torn tail cut off; `next_lsn`: the LSN of
        the next record when the log holds none (the LSN its datastore's files include, plus one)."""
        self.path = path
        contents = read_log(path)
        if contents.torn_bytes:
            log.warning(
                "%s: discarded a torn tail of %d bytes after LSN %s (a write cut short by a crash; it was never acknowledged)",
                path,
                contents.torn_bytes,
                contents.records[-1].lsn if contents.records else "none",
            )
        self._records = contents.records  # what was in the log when it was opened, until the caller takes them
        created = not path.exists()
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            if contents.end < len(MAGIC):
                os.ftruncate(self._fd, 0)
                os.write(self._fd, MAGIC)
                contents = LogContents([], len(MAGIC), len(MAGIC))
            elif contents.torn_bytes:
                os.ftruncate(self._fd, contents.end)
            os.fsync(self._fd)
            if created:
                fsync_path(path.parent)
            os.lseek(self._fd, 0, os.SEEK_END)
        except BaseException:
            os.close(self._fd)
            raise
        self.next_lsn = self._records[-1].lsn + 1 if self._records else next_lsn
        self.bytes = contents.end
        self._lock = threading.Lock()

    def take_records(self) -> list[LogRecord]:
        """What the log held when it was opened, to replay: handed over once, not kept (a long log
        holds every write's embeddings)."""
        records, self._records = self._records, []
        return records

    def append(self, payloads: list[bytes]) -> list[int]:
        """Append one record per payload (not yet durable: `sync`); their LSNs."""
        with self._lock:
            if self._fd < 0:
                raise DatastoreError(f"{self.path} is closed")
            lsns = list(range(self.next_lsn, self.next_lsn + len(payloads)))
            data = b"".join(encode_record(lsn, payload) for lsn, payload in zip(lsns, payloads, strict=True))
            written = 0
            while written < len(data):
                written += os.write(self._fd, data[written:])
            self.next_lsn += len(payloads)
            self.bytes += len(data)
            return lsns

    def sync(self) -> None:
        """Make every record appended so far durable."""
        os.fsync(self._fd)

    @property
    def last_lsn(self) -> int:
        return self.next_lsn - 1

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1
