"""The asyncio event loop every ringserve process runs: uvloop (a dependency) when it imports."""
from __future__ import annotations

import asyncio


def new_event_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is in install_requires
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()
