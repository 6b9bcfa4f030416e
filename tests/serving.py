"""Real `telerag serve` processes for tests: a tiny random LM saved as a model directory, a small
datastore built with the tiny embedder, and a server on a free loopback port, started and
waited for. Its output goes to a file (a pipe nobody reads would fill and block the server).
And an ASGI app served by uvicorn over a real socket, in a thread of the test process."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
import uvicorn

from telerag.benchmarks.random_llm import tiny_random_lm
from telerag.pipelines.embedder import Embedder
from telerag.retrieval.builder import build_datastore
from telerag.retrieval.corpus import WIKIPEDIA_SOURCE, Article, PassageShape, read_wikipedia, split_passages
from telerag.utils.processes import free_port
from tests.tiny_models import tiny_embedder_dir

ROOT = Path(__file__).resolve().parents[1]


def save_tiny_lm(directory: Path, seed: int = 0) -> Path:
    """The tiny random LM of `tiny_random_lm` as a transformers directory (`--model DIR`)."""
    model, tokenizer = tiny_random_lm(seed)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def build_small_datastore(out_dir: Path, embedder_dir: Path | None = None, articles: int = 60) -> Path:
    """A datastore of `articles` short articles, embedded with the tiny embedder (by default
    `tiny_embedder_dir(32, 0)`, which `--embedder` must then name)."""
    embedder = Embedder(embedder_dir or tiny_embedder_dir(32, 0))
    corpus = [
        Article(id=f"a{i}", title=f"Article {i}", text=f"Article {i} is about topic {i % 7}. " * 20) for i in range(articles)
    ]
    return build_datastore(split_passages(corpus), embedder.encode, embedder=embedder.name, out_dir=out_dir, progress=False)


def build_wikipedia_slice(out_dir: Path, titles: Sequence[str], others: int) -> Path:
    """The built-in Wikipedia datastore as the embedded default builds it (the packaged MiniLM,
    the default passage shape), of only the articles `titles` and the first `others` more: a
    minute's embedding on two cores instead of the whole set's four."""
    articles = list(read_wikipedia())
    chosen = [a for a in articles if a.title in titles] + [a for a in articles if a.title not in titles][:others]
    embedder, shape = Embedder.embedded_default(), PassageShape()
    return build_datastore(
        shape.split(chosen), embedder.encode, embedder=embedder.name, out_dir=out_dir, source=WIKIPEDIA_SOURCE, shape=shape,
        progress=False,
    )  # fmt: skip


@dataclass
class ServerProcess:
    process: subprocess.Popen
    base: str
    log: Path

    def output(self) -> str:
        return self.log.read_text(encoding="utf-8", errors="replace")

    def wait_ready(self, timeout: float = 300) -> None:
        """Until `/ready` answers 200; fails with the server's output if it exits first."""
        deadline = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None:
                raise AssertionError(f"telerag serve exited with {self.process.returncode}:\n{self.output()[-4000:]}")
            try:
                if httpx.get(f"{self.base}/ready", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, f"telerag serve did not become ready:\n{self.output()[-4000:]}"
            time.sleep(0.2)

    def signal(self, signum: int = signal.SIGTERM) -> None:
        self.process.send_signal(signum)

    def stop(self) -> None:
        """Kill it if it still runs (test clean-up)."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()


def start_server(
    args: Sequence[str],
    log: Path,
    *,
    env: dict[str, str] | None = None,
    cwd: Path = ROOT,
    command: Sequence[str] = (sys.executable, "-m", "telerag.cli"),
) -> ServerProcess:
    """`command serve ARGS --port PORT` on a free port, output to `log`; `env` adds to the environment."""
    port = free_port()
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", **(env or {})}
    environment.pop("TELERAG_CONFIG", None)
    with log.open("w") as out:
        process = subprocess.Popen(
            [*command, "serve", *args, "--port", str(port)],
            cwd=cwd,
            env=environment,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    return ServerProcess(process, f"http://127.0.0.1:{port}", log)


@contextlib.contextmanager
def serving(app, **options) -> Iterator[str]:
    """`app` under uvicorn (`options` for its Config) on a free loopback port; yields its base
    URL, stops it on exit."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, **{"log_level": "warning", **options}))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(60)
        sock.close()
