"""A server process with SGLangEngine over the fake `sglang` of `tests/fake_sglang.py`
(SGLang's signal handlers and logging included) and a recording retriever, served exactly as
`telerag serve` serves (its lifecycle: listen, load, drain at SIGTERM, exit):
`python -m tests.sglang_server PORT`. Each answer takes about two seconds. On exit it prints
one JSON line: what the fake SGLang saw of the shutdown."""

from __future__ import annotations

import json
import sys
import types

from telerag.config.settings import Settings
from telerag.engines.sglang import SGLangEngine
from telerag.server.process import runtime as runtime_module
from telerag.server.process.event_loop import run_event_loop
from telerag.server.process.lifecycle import Lifecycle
from telerag.server.process.runtime import Runtime
from telerag.server.process.serve import serve
from tests.fake_app import DATASTORE_INFO
from tests.fake_sglang import FakeEngine, Script
from tests.fakes import RecordingRetriever

ANSWER = ["Paris"] + [" is"] * 39


async def load_fake_runtime(settings: Settings, lifecycle: Lifecycle, *, writable: bool = False) -> Runtime:
    """What `load_runtime` would load, with SGLang's fake as the engine (and no datastore to write)."""
    engine = SGLangEngine("fake-model", module=types.SimpleNamespace(Engine=FakeEngine))  # type: ignore[arg-type]
    fake = FakeEngine.instances[0]

    def report() -> None:  # after the engine is closed
        print(json.dumps({"shutdown_calls": fake.shutdown_calls, "sglang_signals": fake.tokenizer_manager.signals}), flush=True)

    return Runtime(
        settings=settings, engine=engine, retriever=RecordingRetriever(), datastore_info=DATASTORE_INFO, closers=[report]
    )


def main(port: int) -> int:
    FakeEngine.default_script, FakeEngine.token_delay_s = Script(ANSWER), 0.05
    settings = Settings(server={"port": port, "log_level": "warning"})
    runtime_module.load_runtime = load_fake_runtime  # serve() loads through this module attribute
    return run_event_loop(serve(settings), settings)


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1])))
