"""Fixtures shared by more than one test module (a fixture one module uses stays in it)."""

from __future__ import annotations

import logging
import signal
import types
from collections.abc import Iterator

import pytest

from tests.fake_sglang import FakeEngine


@pytest.fixture(autouse=True, scope="session")
def measured_at_every_start() -> Iterator[None]:
    """Every server the suite starts (in process or as `telerag serve`) measures itself at start,
    keeping nothing for the next (`server.calibration_dir`): one test's server never starts from
    another's measurements. The tests of keeping them set a directory of their own."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TELERAG_SERVER__CALIBRATION_DIR", "null")
        yield


@pytest.fixture
def sglang() -> Iterator[types.ModuleType]:
    """The fake `sglang` module, its class state reset; the root logger and the signal handlers
    it may change are put back afterwards, whatever the adapter did."""
    FakeEngine.instances, FakeEngine.scripts, FakeEngine.tokenizer = [], {}, None
    FakeEngine.default_script, FakeEngine.token_delay_s = None, 0.0
    FakeEngine.fail_start = FakeEngine.fail_request = FakeEngine.fail_midway = None
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    handlers_before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGQUIT)}
    yield types.SimpleNamespace(Engine=FakeEngine)  # type: ignore[misc]
    for engine in FakeEngine.instances:
        if engine.tokenizer_manager.event_loop is not None and not engine.tokenizer_manager.event_loop.is_closed():
            for sig in handlers_before:
                engine.tokenizer_manager.event_loop.remove_signal_handler(sig)
    for sig, handler in handlers_before.items():
        signal.signal(sig, handler)
    root.handlers[:], root.level = handlers, level


@pytest.fixture(scope="module")
def base_datastore(tmp_path_factory):
    """80 small articles on 8 topics in 8 lists, under the tiny 32-d embedder (the benchmarks scale it up)."""
    from telerag.pipelines.embedder import Embedder  # torch: only for the modules that use it
    from telerag.retrieval.builder import build_datastore
    from telerag.retrieval.corpus import Article, split_passages
    from tests.tiny_models import tiny_embedder_dir

    embedder = Embedder(tiny_embedder_dir(32, 0))
    topics = ["rivers", "mountains", "painters", "planets", "languages", "wars", "chemistry", "music"]
    articles = [
        Article(id=f"a{i}", title=f"Article {i}", text=f"Article {i} tells about {topics[i % len(topics)]} number {i}. " * 15)
        for i in range(80)
    ]
    out = tmp_path_factory.mktemp("base") / "datastore"
    build_datastore(split_passages(articles), embedder.encode, embedder=embedder.name, out_dir=out, nlist=8, progress=False)
    return out


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The modules marked `minutes(n)` first, the longest first, so that with workers they start
    at once rather than last, when the other worker has nothing left to run beside them."""

    def minutes(item: pytest.Item) -> float:
        marker = item.get_closest_marker("minutes")
        return marker.args[0] if marker else 0.0

    items.sort(key=minutes, reverse=True)
