"""The distribution as a user installs it: the wheel holds one import namespace, `telerag`, with
the packaged defaults inside it, and `telerag serve` from that install (not this checkout) answers
a query from a directory outside the checkout. Slow: builds the wheel and starts a server."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import httpx
import pytest

from telerag.pipelines.engines.cpu import tiny_random_lm
from telerag.pipelines.embedder import Embedder
from telerag.retrieval.builder import build_datastore
from telerag.retrieval.corpus import Article, split_passages
from tests.tiny_models import tiny_embedder_dir

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
DISTRIBUTED = ["pyproject.toml", "README.md", "config", "pipelines", "retrieval", "server"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """Built from a copy of what the Dockerfile copies (the build writes build/ where it runs)."""
    source = tmp_path_factory.mktemp("source")
    for name in DISTRIBUTED:
        copy = shutil.copytree if (ROOT / name).is_dir() else shutil.copy2
        copy(ROOT / name, source / name, **({"ignore": shutil.ignore_patterns("__pycache__")} if copy is shutil.copytree else {}))
    out = tmp_path_factory.mktemp("dist")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w", str(out), str(source)],
        check=True, cwd=out,
    )
    (wheel,) = out.glob("telerag-*.whl")
    return wheel


def test_the_wheel_installs_one_namespace_with_its_defaults(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert {name.split("/")[0] for name in names} == {"telerag", wheel.name.split("-py")[0] + ".dist-info"}
    for packaged in ("default.yaml", "prefetch_profiles.yaml", "questions_wiki_en.txt"):
        assert f"telerag/config/{packaged}" in names
    assert not [name for name in names if "/tests/" in name or name.endswith(".pyc")]


def test_installed_wheel_serves_from_another_directory(wheel, tmp_path):
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(site), str(wheel)], check=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {**os.environ, "PYTHONPATH": str(site), "HF_HUB_OFFLINE": "1", "TELERAG_CACHE_DIR": str(tmp_path / "cache")}
    env.pop("TELERAG_CONFIG", None)
    where = subprocess.run(
        [sys.executable, "-c", "import telerag.server.settings as s; print(s.__file__); print(s.DEFAULT_CONFIG)"],
        cwd=elsewhere, env=env, check=True, capture_output=True, text=True,
    ).stdout.split()
    assert all(Path(path).is_relative_to(site) for path in where), where  # the install, not this checkout

    model_dir = tmp_path / "tiny-lm"
    model, tokenizer = tiny_random_lm(0)
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    embedder_dir = tiny_embedder_dir(32, 0)
    embedder = Embedder(embedder_dir)
    articles = [Article(id=f"a{i}", title=f"Article {i}", text=f"Article {i} is about topic {i % 7}. " * 20) for i in range(60)]
    datastore = tmp_path / "datastore"
    build_datastore(split_passages(articles), embedder.encode, embedder=embedder.name, out_dir=datastore, progress=False)

    port = free_port()
    process = subprocess.Popen(
        [str(site / "bin" / "telerag"), "serve", "--model", str(model_dir), "--embedder", str(embedder_dir),
         "--datastore", str(datastore), "--port", str(port)],
        cwd=elsewhere, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if process.poll() is not None:
                pytest.fail(f"telerag serve exited with {process.returncode}:\n{process.stdout.read()[-4000:]}")
            try:
                if httpx.get(f"{base}/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "telerag serve did not become ready"
            time.sleep(0.5)
        response = httpx.post(f"{base}/v1/rag/query", json={"query": "What is topic 3 about?", "max_tokens": 8}, timeout=120)
        assert response.status_code == 200, response.text
        assert response.json()["documents"]
    finally:
        process.terminate()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
