"""The distribution as a user installs it: the wheel holds one import namespace, `telerag`, with
the packaged defaults inside it, and `telerag serve` from that install (not this checkout) answers
a query from a directory outside the checkout. Slow: builds the wheel and starts a server."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from pathlib import Path

import httpx
import pytest

from tests.serving import build_small_datastore, save_tiny_lm, start_server
from tests.tiny_models import tiny_embedder_dir

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
# what the Dockerfile's wheel stage copies: the two files and every folder the wheel maps into `telerag`
PACKAGE_DIRS = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]["package-dir"]
DISTRIBUTED = ["pyproject.toml", "README.md", *sorted(set(PACKAGE_DIRS.values()))]


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
        check=True,
        cwd=out,
    )
    (wheel,) = out.glob("telerag-*.whl")
    return wheel


def test_the_wheel_installs_one_namespace_with_its_defaults(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert {name.split("/")[0] for name in names} == {"telerag", wheel.name.split("-py")[0] + ".dist-info"}
    for packaged in ("default.yaml", "prefetch_profiles.yaml", "questions_wiki_en.txt"):
        assert f"telerag/config/{packaged}" in names
    for package in ("benchmarks", "engines", "pipelines", "retrieval", "server"):  # `telerag bench` runs from the wheel too
        assert f"telerag/{package}/__init__.py" in names
    assert not [name for name in names if "/tests/" in name or name.endswith(".pyc")]


def test_installed_wheel_serves_from_another_directory(wheel, tmp_path):
    site = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(site), str(wheel)], check=True
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    # `-S`: no site processing, so the editable install of this checkout (a .pth hook in this
    # environment's site-packages) cannot fill in what the wheel lacks; the dependencies come
    # from that site-packages on the path
    python = [sys.executable, "-S"]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(site), sysconfig.get_paths()["purelib"]]),
        "HF_HUB_OFFLINE": "1",
        "TELERAG_CACHE_DIR": str(tmp_path / "cache"),
    }
    env.pop("TELERAG_CONFIG", None)
    where = subprocess.run(
        [*python, "-c", "import telerag, telerag.config.settings as s; print(*telerag.__path__, s.__file__, s.DEFAULT_CONFIG)"],
        cwd=elsewhere,
        env=env,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    assert all(Path(path).is_relative_to(site) for path in where), where  # the install alone, not this checkout

    model_dir = save_tiny_lm(tmp_path / "tiny-lm")
    embedder_dir = tiny_embedder_dir(32, 0)
    datastore = build_small_datastore(tmp_path / "datastore", embedder_dir)
    server = start_server(
        ["--model", str(model_dir), "--embedder", str(embedder_dir), "--datastore", str(datastore)],
        tmp_path / "server.log",
        env=env,
        cwd=elsewhere,
        command=[*python, str(site / "bin" / "telerag")],
    )
    try:
        server.wait_ready()
        response = httpx.post(
            f"{server.base}/v1/rag/query", json={"query": "What is topic 3 about?", "max_tokens": 8}, timeout=120
        )
        assert response.status_code == 200, response.text
        assert response.json()["documents"]
        server.signal(signal.SIGTERM)
        assert server.process.wait(timeout=60) == 0
    finally:
        server.stop()
