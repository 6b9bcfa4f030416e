"""The Files API: files uploaded, listed, read back and deleted through the official
`openai` SDK, kept durably (a new store over the same directory has them; an upload cut short
leaves nothing), each seen only by the API key that uploaded it, limits and types refused."""

from __future__ import annotations

import openai
import pytest

from telerag.file_search.errors import FilesTooLarge
from telerag.file_search.file_store import FileStore
from tests.fake_app import Harness, sdk

MARKDOWN = b"# Harbour notes\n\nThe harbour has towers of blue pumpkins.\n"
PDF = b"%PDF-1.4\n% a PDF is kept as it came: converted when a vector store reads it\n%%EOF\n"


def harness(tmp_path, files: dict | None = None, **sections) -> Harness:
    return Harness(files={"dir": str(tmp_path / "files"), **(files or {})}, **sections)


def keyed(http, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url="http://test/v1", api_key=key, http_client=http, max_retries=0)


async def test_files_go_in_list_read_back_and_go_out_through_the_sdk(tmp_path):
    async with harness(tmp_path).client() as http:
        client = sdk(http)
        notes = await client.files.create(file=("notes.md", MARKDOWN), purpose="assistants")
        report = await client.files.create(file=("report.pdf", PDF, "application/pdf"), purpose="user_data")
        assert notes.id.startswith("file-") and notes.id != report.id
        assert (notes.object, notes.filename, notes.bytes, notes.purpose, notes.status) == (
            "file",
            "notes.md",
            len(MARKDOWN),
            "assistants",
            "processed",
        )
        assert (await client.files.retrieve(report.id)).model_dump() == report.model_dump()
        assert (await client.files.content(notes.id)).read() == MARKDOWN
        assert (await client.files.content(report.id)).read() == PDF

        listed = [f.id async for f in client.files.list()]  # the newest first
        assert listed == [report.id, notes.id]
        assert [f.id async for f in client.files.list(order="asc", limit=1)] == [notes.id, report.id]  # page by page
        assert [f.id async for f in client.files.list(purpose="assistants")] == [notes.id]

        deleted = await client.files.delete(notes.id)
        assert (deleted.id, deleted.deleted) == (notes.id, True)
        with pytest.raises(openai.NotFoundError) as gone:
            await client.files.retrieve(notes.id)
        assert gone.value.code == "file_not_found" and gone.value.type == "invalid_request_error"
        with pytest.raises(openai.NotFoundError):
            await client.files.delete(notes.id)
        assert [f.id async for f in client.files.list()] == [report.id]


async def test_a_type_it_does_not_convert_and_a_purpose_it_does_not_serve_are_refused_naming_them(tmp_path):
    async with harness(tmp_path).client() as http:
        client = sdk(http)
        with pytest.raises(openai.BadRequestError) as image:
            await client.files.create(file=("photo.png", b"\x89PNG\r\n", "image/png"), purpose="assistants")
        assert image.value.code == "unsupported_file" and "image/png" in image.value.message
        with pytest.raises(openai.BadRequestError) as purpose:
            await client.files.create(file=("notes.md", MARKDOWN), purpose="fine-tune")
        assert purpose.value.code == "unsupported_field" and purpose.value.param == "purpose"
        assert [f async for f in client.files.list()] == []


async def test_one_key_never_sees_reads_or_deletes_anothers_file(tmp_path):
    h = harness(tmp_path, server={"api_keys": ["key-of-ann", "key-of-bob"]})
    async with h.client() as http:
        ann, bob = keyed(http, "key-of-ann"), keyed(http, "key-of-bob")
        mine = await ann.files.create(file=("notes.md", MARKDOWN), purpose="assistants")
        assert [f async for f in bob.files.list()] == []
        for call in (bob.files.retrieve, bob.files.content, bob.files.delete):
            with pytest.raises(openai.NotFoundError):
                await call(mine.id)
        with pytest.raises(openai.AuthenticationError):
            await keyed(http, "nobody").files.list()
        assert [f.id async for f in ann.files.list()] == [mine.id]
    # the key's files stay its own across a restart, and however the keys are listed
    h = harness(tmp_path, server={"api_keys": ["key-of-bob", "key-of-ann"]})
    async with h.client() as http:
        assert [f.id async for f in keyed(http, "key-of-ann").files.list()] == [mine.id]
        assert [f async for f in keyed(http, "key-of-bob").files.list()] == []


def test_files_are_durable_and_an_upload_cut_short_leaves_nothing(tmp_path):
    root = tmp_path / "files"
    store = FileStore(root, max_bytes=1024, max_bytes_per_owner=2048)
    kept = store.add(MARKDOWN, "notes.md", "assistants", "key-a")
    (root / "file-cut-short.bin").write_bytes(b"half an upload")  # its description never written
    (root / ".file-other.json.tmp-1-2").write_bytes(b"{")  # a description's temporary file, never renamed
    again = FileStore(root, max_bytes=1024, max_bytes_per_owner=2048)  # a restart
    assert again.files("key-a") == [kept] and again.content(kept.id, "key-a") == MARKDOWN
    assert sorted(p.name for p in root.iterdir()) == [f"{kept.id}.bin", f"{kept.id}.json"]
    with pytest.raises(FilesTooLarge, match=r"files\.max_bytes "):
        again.add(b"x" * 1025, "big.txt", "assistants", "key-a")
    again.add(b"x" * 1000, "a.txt", "assistants", "key-a")
    with pytest.raises(FilesTooLarge, match=r"files\.max_bytes_per_key"):
        again.add(b"x" * 1000, "b.txt", "assistants", "key-a")  # 1,000 + 1,000 + the notes' bytes, over 2,048
    assert again.add(b"x" * 1000, "b.txt", "assistants", "key-b").owner == "key-b"  # another key's own room


async def test_a_file_over_the_limit_is_refused_with_413(tmp_path):
    async with harness(tmp_path, files={"max_bytes": 2048}).client() as http:
        with pytest.raises(openai.APIStatusError) as big:
            await sdk(http).files.create(file=("big.txt", b"x" * 4096), purpose="assistants")
    assert big.value.status_code == 413 and big.value.code == "files_too_large"
