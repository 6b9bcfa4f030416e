"""A datastore's checksums read once as its files lie on disk: an open reads only the files that
changed since they last passed (a write in place, a copy), still refuses any damage, and
`telerag datastore verify` reads every byte whatever was recorded."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest

import telerag.retrieval.checksums as checksums
from telerag.cli.main import main
from telerag.retrieval.datastore import VECTORS, Datastore, Manifest
from telerag.retrieval.errors import DatastoreCorruptError
from tests.retrieval_helpers import random_datastore

SETTLE_NS = 50_000_000


@pytest.fixture
def reads(monkeypatch) -> list[str]:
    """The names of the files read against their checksums, in order; files settle after 50 ms."""
    names: list[str] = []
    sha256 = checksums.file_sha256

    def counted(path, bar=None):
        names.append(path.name)
        return sha256(path, bar)

    monkeypatch.setattr(checksums, "file_sha256", counted)
    monkeypatch.setattr(checksums, "RACY_NS", SETTLE_NS)
    return names


def flip_a_byte(path: Path) -> None:
    """One byte near the end changed in place: the same inode and size."""
    with path.open("r+b") as handle:
        handle.seek(-7, 2)
        byte = handle.read(1)[0]
        handle.seek(-7, 2)
        handle.write(bytes([byte ^ 0xFF]))


def settled_and_recorded(tmp_path, reads: list[str]) -> Datastore:
    """A datastore whose every file passed at an open after it settled."""
    datastore = random_datastore(tmp_path / "ds")
    time.sleep(2 * SETTLE_NS / 1e9)
    Datastore.load(datastore.path).close()
    assert (datastore.path / checksums.VERIFIED).is_file()
    reads.clear()
    return datastore


def test_an_open_reads_no_file_that_passed_and_refuses_one_written_since(tmp_path, reads):
    datastore = settled_and_recorded(tmp_path, reads)
    Datastore.load(datastore.path).close()
    assert reads == []
    vectors = datastore.path / VECTORS
    inode, size = vectors.stat().st_ino, vectors.stat().st_size
    flip_a_byte(vectors)
    assert (vectors.stat().st_ino, vectors.stat().st_size) == (inode, size)
    with pytest.raises(DatastoreCorruptError, match="checksum"):
        Datastore.load(datastore.path)
    assert reads == [VECTORS]


def test_a_copy_is_read_again_in_full(tmp_path, reads):
    datastore = settled_and_recorded(tmp_path, reads)
    copy = shutil.copytree(datastore.path, tmp_path / "copy")  # times kept, new inodes
    Datastore.load(copy).close()
    assert sorted(reads) == sorted(Manifest.read(copy).files)


def test_a_file_changed_just_before_its_check_is_read_again_at_the_next_open(tmp_path, reads, monkeypatch):
    datastore = random_datastore(tmp_path / "ds")
    monkeypatch.setattr(checksums, "RACY_NS", 10**18)  # nothing ever settles
    for _ in range(2):
        reads.clear()
        Datastore.load(datastore.path).close()
        assert sorted(reads) == sorted(Manifest.read(datastore.path).files)


def test_the_writer_records_what_it_read_back(tmp_path, reads, monkeypatch):
    monkeypatch.setattr(checksums, "RACY_NS", 0)
    datastore = random_datastore(tmp_path / "ds")  # written, then opened
    assert reads == [] and datastore.n_vectors > 0


def test_where_nothing_can_be_recorded_every_open_reads_every_file(tmp_path, reads, monkeypatch):
    datastore = random_datastore(tmp_path / "ds")
    (datastore.path / checksums.VERIFIED).unlink(missing_ok=True)
    time.sleep(2 * SETTLE_NS / 1e9)

    def read_only(target, data):
        raise PermissionError(13, "Read-only file system", str(target))

    monkeypatch.setattr(checksums, "write_by_rename", read_only)
    for _ in range(2):
        reads.clear()
        Datastore.load(datastore.path).close()
        assert sorted(reads) == sorted(Manifest.read(datastore.path).files)
    assert not (datastore.path / checksums.VERIFIED).exists()


def test_an_unreadable_record_is_read_as_none_and_written_again(tmp_path, reads):
    datastore = settled_and_recorded(tmp_path, reads)
    (datastore.path / checksums.VERIFIED).write_text("{not json", encoding="utf-8")
    Datastore.load(datastore.path).close()
    assert sorted(reads) == sorted(Manifest.read(datastore.path).files)
    reads.clear()
    Datastore.load(datastore.path).close()
    assert reads == []


def test_verify_reads_every_byte_whatever_was_recorded(tmp_path, reads, capsys):
    datastore = settled_and_recorded(tmp_path, reads)
    files = Manifest.read(datastore.path).files
    assert main(["datastore", "verify", str(datastore.path), "--json"]) == 0
    verified = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert verified == {"generation": 0, "files": len(files), "bytes_read": sum(int(meta["bytes"]) for meta in files.values())}
    assert sorted(reads) == sorted(files)

    flip_a_byte(datastore.path / VECTORS)
    assert main(["datastore", "verify", str(datastore.path)]) == 1
    assert f"{datastore.path / VECTORS} fails its sha256 checksum" in capsys.readouterr().err
