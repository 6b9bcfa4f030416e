"""A server process with SGLangEngine over the fake `sglang` of `tests/test_engine_sglang.py`
(SGLang's signal handlers and logging included) and a recording retriever, served by uvicorn
as `telerag serve` serves: `python -m tests.sglang_server PORT`. Each answer takes about two
seconds. On exit it prints one JSON line: what the fake SGLang saw of the shutdown."""

from __future__ import annotations

import json
import sys
import types

import uvicorn

from telerag.pipelines.engines.sglang import SGLangEngine
from telerag.server.app import create_app
from telerag.server.runtime import Runtime, run_event_loop
from telerag.server.settings import Settings
from tests.fakes import RecordingRetriever
from tests.test_engine_sglang import FakeEngine, Script

ANSWER = ["Paris"] + [" is"] * 39


def main(port: int) -> None:
    FakeEngine.default_script, FakeEngine.token_delay_s = Script(ANSWER), 0.05
    settings = Settings(server={"port": port})

    async def serve() -> None:
        engine = SGLangEngine("fake-model", module=types.SimpleNamespace(Engine=FakeEngine))  # type: ignore[arg-type]
        fake = FakeEngine.instances[0]

        def report() -> None:  # after the engine is closed (uvicorn then re-raises SIGTERM)
            print(json.dumps({"shutdown_calls": fake.shutdown_calls, "sglang_signals": fake.tokenizer_manager.signals}), flush=True)

        runtime = Runtime(settings=settings, engine=engine, retriever=RecordingRetriever(), closers=[report])
        config = uvicorn.Config(create_app(runtime), host="127.0.0.1", port=port, log_level="warning",
                                timeout_graceful_shutdown=30)
        await uvicorn.Server(config).serve()

    run_event_loop(serve(), settings)


if __name__ == "__main__":
    main(int(sys.argv[1]))
