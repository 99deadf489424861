"""Background loops that live as long as their process (discovery, health checks, the coordinator
feed): a crash is logged and the loop restarted, so one bad response never ends a loop for good."""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable


def restarting_task(run: Callable[[], Awaitable[None]], what: str, log: logging.Logger) -> asyncio.Future:
    async def guarded() -> None:
        while True:
            try:
                await run()
                return
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("%s failed; restarting in 1 s", what)
                await asyncio.sleep(1.0)

    return asyncio.ensure_future(guarded())
