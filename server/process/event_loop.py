"""The event loop every serving command runs on (`serve`, the benchmarks that serve): here, not
in the runtime, so that `telerag serve` starts it and listens before torch is imported."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Coroutine
from typing import Any, TypeVar

from telerag.config.settings import Settings

T = TypeVar("T")


def run_event_loop(main: Coroutine[Any, Any, T], settings: Settings) -> T:
    """Run the server's event loop: uvloop when installed (uvicorn's own choice), asyncio
    otherwise; with the GIL switch interval the settings ask for."""
    sys.setswitchinterval(settings.server.switch_interval_ms / 1e3)
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main)
