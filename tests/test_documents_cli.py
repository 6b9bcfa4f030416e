"""`telerag documents` as a user runs it: a folder of Markdown, text, HTML and PDF files added to a
running `telerag serve` (`--url`), added again (only what changed is rewritten), synced after a
file is gone, listed, removed; each document answered from by the next query; and the same
straight into a datastore directory, refused while a server holds it. Tiny models, a small
datastore. Slow: a server process and several command-line runs."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.serving import ROOT, build_small_datastore, save_tiny_lm, start_server
from tests.tiny_models import tiny_embedder_dir

pytestmark = [pytest.mark.slow, pytest.mark.minutes(2)]  # the folder's test about 2 min in CI


def pdf_bytes(text: str) -> bytes:
    """A one-page PDF whose text layer is `text` (Helvetica, one line)."""
    stream = f"BT /F1 12 Tf 72 720 Td ({text}) Tj ET".encode()
    objects = [
        b"<< /Type /Catalog /Pages 2 0 R >>",
        b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
        b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents 4 0 R /Resources << /Font << /F1 5 0 R >> >> >>",
        b"<< /Length %d >>\nstream\n%s\nendstream" % (len(stream), stream),
        b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>",
    ]
    out, offsets = b"%PDF-1.4\n", []
    for number, body in enumerate(objects, 1):
        offsets.append(len(out))
        out += b"%d 0 obj\n%s\nendobj\n" % (number, body)
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1)
    out += b"".join(b"%010d 00000 n \n" % offset for offset in offsets)
    return out + b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(objects) + 1, xref)


def telerag(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "telerag.cli", *args], cwd=cwd, env=env, capture_output=True, text=True, check=False
    )


def top_document(base: str, query: str) -> str:
    response = httpx.post(f"{base}/v1/rag/query", json={"query": query, "max_tokens": 2, "top_k": 1}, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["documents"][0]["doc_id"]


def test_a_folder_through_the_server_and_into_a_directory(tmp_path):
    embedder = tiny_embedder_dir(32, 0)
    datastore = build_small_datastore(tmp_path / "datastore", embedder, articles=20)
    lm = save_tiny_lm(tmp_path / "tiny-lm")
    notes = tmp_path / "work" / "notes"
    notes.mkdir(parents=True)
    (notes / "a.md").write_text("# Alpacas\n\nAlpacas graze on the high Andes plateau.\n")
    (notes / "b.txt").write_text("Basalt forms when lava cools quickly at the surface.\n")
    (notes / "c.html").write_text("<html><title>Comets</title><body><p>Comets carry ice from the outer system.</p></body></html>")
    (notes / "d.pdf").write_bytes(pdf_bytes("Dolphins sleep with one half of the brain at a time."))
    (notes / "skip.png").write_bytes(b"\x89PNG")
    work = notes.parent
    directory = ["--datastore", str(datastore), "--embedder", str(embedder)]

    server = start_server(
        ["--model", str(lm), "--embedder", str(embedder), "--datastore", str(datastore)],
        tmp_path / "server.log",
        env={"TELERAG_SERVER__WARM_UP": "false"},
    )
    try:
        server.wait_ready(timeout=180)
        url = ["--url", server.base]
        added = telerag("documents", "add", "notes", *url, cwd=work)
        assert added.returncode == 0, added.stderr
        assert added.stdout.strip() == "4 created"
        listed = telerag("documents", "ls", *url, cwd=work).stdout
        assert {"notes/a.md", "notes/b.txt", "notes/c.html", "notes/d.pdf"} <= {
            line.split("\t")[0] for line in listed.splitlines()
        }
        assert "\tAlpacas\n" in listed + "\n" and "\tComets" in listed
        assert top_document(server.base, "Dolphins sleep with one half of the brain at a time.") == "notes/d.pdf"
        assert top_document(server.base, "Basalt forms when lava cools quickly at the surface.") == "notes/b.txt"

        assert telerag("documents", "add", "notes", *url, cwd=work).stdout.strip() == "4 unchanged"
        # the same files are the same documents from any working directory, however the folder is named
        assert telerag("documents", "add", ".", *url, cwd=notes).stdout.strip() == "4 unchanged"
        assert telerag("documents", "add", str(notes) + "/", *url, cwd=tmp_path).stdout.strip() == "4 unchanged"
        (notes / "a.md").write_text("# Alpacas\n\nAlpacas hum to one another.\n")
        (notes / "b.txt").unlink()
        synced = telerag("documents", "add", "notes", "--sync", *url, cwd=work)
        assert synced.stdout.strip() == "1 deleted, 1 replaced, 2 unchanged", synced.stderr
        assert top_document(server.base, "Basalt forms when lava cools quickly at the surface.") != "notes/b.txt"

        on_server = telerag("datastore", "compact", *url, cwd=work)
        assert on_server.returncode == 0 and on_server.stdout.startswith("generation 1:"), on_server.stderr
        assert top_document(server.base, "Dolphins sleep with one half of the brain at a time.") == "notes/d.pdf"

        busy = telerag("documents", "add", "notes", *directory, cwd=work)
        assert busy.returncode != 0 and "held for writing by another process" in busy.stderr
        removed = telerag("documents", "rm", "notes/a.md", "notes/nothing.md", *url, cwd=work)
        assert removed.stdout.splitlines() == ["notes/a.md: deleted", "notes/nothing.md: not_found"] and removed.returncode == 1
    finally:
        server.stop()

    more = work / "more"
    shutil.copytree(notes, more)
    (more / "e.md").write_text("Emus cannot walk backwards.\n")
    direct = telerag("documents", "add", "more", *directory, cwd=work)
    assert direct.returncode == 0, direct.stderr
    assert direct.stdout.strip() == "4 created"  # a.md, c.html, d.pdf and e.md
    listed = telerag("documents", "ls", *directory, cwd=work).stdout
    assert "more/e.md" in listed and "notes/c.html" in listed and "notes/a.md" not in listed
    info = json.loads(telerag("datastore", "info", str(datastore), "--json", cwd=work).stdout)
    assert info["documents"] == 20 + 2 + 4 and info["lsn"] == 4 + 2 + 1 + 4  # a write a document: added, synced, rm, added
    assert info["delta_rows"] > 0 and info["tombstones"] > 0 and info["ingestion"] == "none"
    compacted = telerag("datastore", "compact", str(datastore), cwd=work)
    assert compacted.returncode == 0 and compacted.stdout.startswith("generation 2:"), compacted.stderr
    info = json.loads(telerag("datastore", "info", str(datastore), "--json", cwd=work).stdout)
    assert info["documents"] == 26 and info["generation"] == 2 and info["delta_rows"] == info["tombstones"] == 0
    assert "more/e.md" in telerag("documents", "ls", *directory, cwd=work).stdout

    prefixed = telerag("documents", "add", "e.md", "--prefix", "kept", *directory, cwd=more)
    assert prefixed.stdout.strip() == "1 created", prefixed.stderr
    folder = telerag("documents", "rm", "more/", "nowhere", *directory, cwd=tmp_path)  # a folder's id takes its documents
    assert folder.stdout.splitlines() == ["more/: 4 deleted", "nowhere: not_found"] and folder.returncode == 1
    ids = {line.split("\t")[0] for line in telerag("documents", "ls", *directory, cwd=work).stdout.splitlines()}
    assert "kept/e.md" in ids and "notes/c.html" in ids and not any(i.startswith("more/") for i in ids)
