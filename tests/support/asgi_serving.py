"""In-process ASGI apps on real 127.0.0.1 sockets, for tests that run the router (and small
stand-in engines) in the test's own event loop, and the reading of their SSE answers."""

from __future__ import annotations

import asyncio
import json
import socket
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Sequence

import httpx
import uvicorn


@asynccontextmanager
async def serving(app: Any) -> AsyncIterator[str]:
    """`app` on a free 127.0.0.1 port in this event loop; yields its URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="auto", timeout_graceful_shutdown=1))
    task = asyncio.ensure_future(server.serve(sockets=[sock]))
    while not server.started:
        assert not task.done(), task.exception()
        await asyncio.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 10)
        sock.close()


@asynccontextmanager
async def serve_all(engines: Sequence[Any]) -> AsyncIterator[list[str]]:
    """Every engine's `app()` served at once; yields their URLs in order."""
    if not engines:
        yield []
        return
    async with serving(engines[0].app()) as url, serve_all(engines[1:]) as rest:
        yield [url, *rest]


async def read_stream(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> list[dict[str, Any] | str]:
    """The events of a streamed answer: JSON objects, and "[DONE]"."""
    events: list[dict[str, Any] | str] = []
    async with client.stream("POST", path, json=dict(body, stream=True)) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                events.append("[DONE]" if line == "data: [DONE]" else json.loads(line[6:]))
    return events
