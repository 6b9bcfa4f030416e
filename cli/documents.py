"""`telerag documents add|rm|ls`: documents into and out of a datastore, through a running server
(`--url`, `--api-key`) or straight into a datastore directory that no server holds.

`add` takes files and folders (recursively, by extension: text, Markdown, HTML, PDF). A document's
id is where its file is in the folder given, under the folder's own name (`notes/a.md` for `add
notes`, `add ./notes/`, `add /home/me/notes` or `add .` in `notes` alike), and a file given alone
is its name: so the same file is the same document from any working directory. `--prefix P` puts
`P` in place of the folder's name (ahead of a file's). Adding a folder again rewrites only what
changed (the datastore compares content hashes), and with `--sync` deletes the documents under
that folder whose files are gone. `rm` takes ids, and a folder's id (`rm notes`) removes every
document under it.
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import quote

import httpx

from telerag.cli.runtime_flags import NULL, nullable
from telerag.config.settings import RetrievalSettings, load_settings
from telerag.documents.conversion import SUPPORTED_EXTENSIONS
from telerag.documents.writer import DocumentWriter, document_of_file
from telerag.retrieval.live import LiveDatastore
from telerag.utils.progress import ProgressBar

BATCH_FILES = 32  # files written to a datastore directory at once (one sync)


class Documents(Protocol):
    """Where the documents go: a server's API or a datastore directory."""

    def add(self, files: list[tuple[str, Path]]) -> list[str]:
        """Write each (id, file); the outcome of each."""
        ...

    def remove(self, doc_ids: list[str]) -> list[str]: ...

    def listing(self) -> Iterator[dict[str, Any]]:
        """Every document's id, version, passage count and title, by id."""
        ...


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("documents", help="add, remove and list documents of a datastore, live")
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    add = actions.add_parser("add", help="write files and folders (recursively: .txt .md .html .pdf) as documents")
    add.add_argument("paths", nargs="+", type=Path)
    add.add_argument("--sync", action="store_true", help="also delete the documents under each folder whose files are gone")
    add.add_argument(
        "--prefix", help="ids under this prefix instead of the folder's name (a file's: ahead of its name); '' for none"
    )
    rm = actions.add_parser("rm", help="delete documents by id; a folder's id (e.g. notes) deletes every one under it")
    rm.add_argument("ids", nargs="+")
    ls = actions.add_parser("ls", help="list the documents: id, version, passages, title")
    for action, run in ((add, run_add), (rm, run_rm), (ls, run_ls)):
        action.add_argument("--url", help="a running server, e.g. http://127.0.0.1:8000 (default: the datastore directory)")
        action.add_argument("--api-key", default=os.environ.get("TELERAG_API_KEY"), help="the server's (env TELERAG_API_KEY)")
        action.add_argument(
            "--datastore", type=Path, help="the directory, which no server may hold (default: the configured one)"
        )
        action.add_argument("--embedder", type=nullable(Path), help="the directory's embedder (default: the configured one)")
        action.add_argument("--config", type=Path, help="YAML settings file (default: config/default.yaml)")
        action.set_defaults(func=run)


def run_add(args: argparse.Namespace) -> int:
    files = list(_files(args.paths, args.prefix))
    with _open(args) as documents:
        outcomes: dict[str, int] = {}
        for outcome in documents.add(files):
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
        if args.sync:
            kept = {doc_id for doc_id, _ in files}
            folders = tuple(_under(_folder_id(path, args.prefix)) for path in args.paths if path.is_dir())
            gone = [d["id"] for d in documents.listing() if d["id"] not in kept and d["id"].startswith(folders)]
            for outcome in documents.remove(gone):
                outcomes[outcome] = outcomes.get(outcome, 0) + 1
    print(", ".join(f"{count} {outcome}" for outcome, count in sorted(outcomes.items())) or "no files")
    return 0


def run_rm(args: argparse.Namespace) -> int:
    """Each id given is removed; one that names no document but a folder of them (`notes` for
    `notes/a.md` and the rest) removes every document under it."""
    asked = [doc_id.strip("/") or doc_id for doc_id in args.ids]
    with _open(args) as documents:
        outcomes = documents.remove(asked)
        folders = [doc_id for doc_id, outcome in zip(asked, outcomes, strict=True) if outcome != "deleted"]
        held = [d["id"] for d in documents.listing()] if folders else []
        under = {folder: [i for i in held if i.startswith(_under(folder))] for folder in folders}
        if found := [i for ids in under.values() for i in ids]:
            documents.remove(found)
    for doc_id, outcome in zip(asked, outcomes, strict=True):
        print(f"{doc_id}/: {len(under[doc_id])} deleted" if under.get(doc_id) else f"{doc_id}: {outcome}")
    return 0 if all(outcome == "deleted" or under.get(doc_id) for doc_id, outcome in zip(asked, outcomes, strict=True)) else 1


def run_ls(args: argparse.Namespace) -> int:
    with _open(args) as documents:
        for d in documents.listing():
            print(f"{d['id']}\tv{d['version']}\t{d['passage_count']} passages\t{d['title']}")
    return 0


def _files(paths: list[Path], prefix: str | None) -> Iterator[tuple[str, Path]]:
    """(id, file) of every file to add: each folder's files of a known type, under the folder's id
    (`_folder_id`), and each file named, by its name (after `prefix`, where one is given)."""
    for path in paths:
        if path.is_dir():
            root = path.resolve()
            folder = _folder_id(path, prefix)
            for file in sorted(root.rglob("*")):
                if file.is_file() and file.suffix.lower() in SUPPORTED_EXTENSIONS:
                    yield _under(folder) + file.relative_to(root).as_posix(), file
        elif path.is_file():
            yield _under(prefix.strip("/") if prefix else "") + path.name, path
        else:
            raise SystemExit(f"telerag documents add: {path}: no such file or folder")


def _folder_id(folder: Path, prefix: str | None) -> str:
    """What a folder's documents' ids start with: `prefix`, else the folder's own name (wherever
    it is, and however it was named: `.`, `./notes/`, an absolute path)."""
    return prefix.strip("/") if prefix is not None else folder.resolve().name


def _under(folder: str) -> str:
    """The start of the ids of the documents in `folder` ('' for none: the ids are the paths)."""
    return folder + "/" if folder else ""


def _open(args: argparse.Namespace) -> AbstractContextManager[Documents]:
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    if args.url:
        return ServerDocuments(args.url, args.api_key)
    chosen = {key: value for key, value in (("datastore", args.datastore), ("embedder", args.embedder)) if value is not None}
    retrieval = {key: None if value is NULL else value for key, value in chosen.items()}
    return DirectoryDocuments(load_settings(args.config, {"retrieval": retrieval}).retrieval)


class ServerDocuments:
    """A running server's `/v1/documents`, one request at a time (a 429 or 503 waits its
    `Retry-After` and tries again, up to `ATTEMPTS` times)."""

    ATTEMPTS = 5

    def __init__(self, url: str, api_key: str | None) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=httpx.Timeout(600, connect=10))

    def __enter__(self) -> ServerDocuments:
        return self

    def __exit__(self, *exc: object) -> None:
        self.client.close()

    def add(self, files: list[tuple[str, Path]]) -> list[str]:
        outcomes = []
        for doc_id, path in ProgressBar(files, desc="add", unit="file"):
            upload = {"file": (path.name, path.read_bytes())}
            outcomes.append(self._send("POST", "/v1/uploads", files=upload, data={"id": doc_id}).json()["outcome"])
        return outcomes

    def remove(self, doc_ids: list[str]) -> list[str]:
        outcomes = []
        for doc_id in ProgressBar(doc_ids, desc="remove", unit="doc", disable=len(doc_ids) < 2):
            response = self._send("DELETE", f"/v1/documents/{quote(doc_id, safe='/')}", missing_ok=True)
            outcomes.append("not_found" if response.status_code == 404 else "deleted")
        return outcomes

    def listing(self) -> Iterator[dict[str, Any]]:
        after: str | None = None
        while True:
            page = self._send("GET", "/v1/documents", params={"limit": 1000, **({"after": after} if after else {})}).json()
            yield from page["data"]
            after = page["last_id"]
            if not page["has_more"]:
                return

    def _send(self, method: str, path: str, *, missing_ok: bool = False, **request: Any) -> httpx.Response:
        for attempt in range(self.ATTEMPTS):
            response = self.client.request(method, path, **request)
            if response.status_code not in (429, 503) or attempt + 1 == self.ATTEMPTS:
                break
            time.sleep(float(response.headers.get("Retry-After", "1")))
        if response.is_success or (missing_ok and response.status_code == 404):
            return response
        try:
            message = response.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = response.text[:200]
        raise SystemExit(f"telerag documents: {method} {path}: {response.status_code} {message}")


class DirectoryDocuments:
    """A datastore directory, written here: held for writing while open (refused while a server
    holds it), its documents embedded by the configured embedder, `BATCH_FILES` files per sync."""

    def __init__(self, retrieval: RetrievalSettings) -> None:
        from telerag.server.process.runtime import load_embedder

        embedder = load_embedder(retrieval)
        self.live = LiveDatastore.open(retrieval.datastore, embedder=embedder.name, dim=embedder.dim, writable=True)
        self.writer = DocumentWriter(self.live, embedder.encode)

    def __enter__(self) -> DirectoryDocuments:
        return self

    def __exit__(self, *exc: object) -> None:
        self.live.close()
        self.live.datastore.close()

    def add(self, files: list[tuple[str, Path]]) -> list[str]:
        outcomes = []
        with ProgressBar[None](total=len(files), desc="add", unit="file") as bar:
            for start in range(0, len(files), BATCH_FILES):
                batch = files[start : start + BATCH_FILES]
                texts = [document_of_file(doc_id, path) for doc_id, path in batch]
                outcomes += [result.outcome.value for result in self.writer.write_now(texts)]
                bar.update(len(batch))
        return outcomes

    def remove(self, doc_ids: list[str]) -> list[str]:
        return [result.outcome.value for result in self.writer.write_now(doc_ids)]

    def listing(self) -> Iterator[dict[str, Any]]:
        after: str | None = None
        while page := self.live.documents(after=after, limit=1000):
            for entry in page:
                yield {
                    "id": entry.doc_id,
                    "version": entry.version,
                    "passage_count": len(entry.passage_ids),
                    "title": entry.title,
                }
            after = page[-1].doc_id
