"""A 500 ends its request, not the client's connection: the next request on the same keep-alive
connection is answered. A stream cut short by an error still ends its connection."""

from __future__ import annotations

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from pdserve.engine.server.errors import error_response
from pdserve.engine.server.http import LimitsAndAuth, ServerSettings

from support.asgi_serving import serving


def app_with_a_failing_route() -> tuple[object, list[int]]:
    """The servers' own wrapping (LimitsAndAuth over FastAPI, a catch-all 500 handler) around routes
    that fail; records the client port of every request, which names its connection."""
    app = FastAPI()
    ports: list[int] = []

    @app.exception_handler(Exception)
    async def unexpected(_: Request, exc: Exception) -> JSONResponse:
        return error_response(500, "Internal server error (error id test).")

    @app.post("/fails")
    async def fails(request: Request) -> dict:
        ports.append(request.client.port)
        raise RuntimeError("a bug")

    @app.post("/works")
    async def works(request: Request) -> dict:
        ports.append(request.client.port)
        return {"ok": True}

    @app.post("/stream-fails")
    async def stream_fails(request: Request) -> StreamingResponse:
        ports.append(request.client.port)

        async def chunks():
            yield b"data: first\n\n"
            raise RuntimeError("a bug mid-stream")

        return StreamingResponse(chunks(), media_type="text/event-stream")

    return LimitsAndAuth(app, ServerSettings(max_body_bytes=1 << 20)), ports


@pytest.mark.asyncio
async def test_the_request_after_a_500_is_answered_on_the_same_connection():
    app, ports = app_with_a_failing_route()
    async with serving(app) as url, httpx.AsyncClient(base_url=url, timeout=10) as client:
        failed = await client.post("/fails", json={})
        assert failed.status_code == 500 and "error id" in failed.json()["error"]["message"]
        after = await client.post("/works", json={})
        assert after.status_code == 200 and after.json() == {"ok": True}
    assert len(ports) == 2 and ports[0] == ports[1], ports  # one connection served both


@pytest.mark.asyncio
async def test_a_stream_cut_short_by_an_error_ends_its_connection():
    app, ports = app_with_a_failing_route()
    async with serving(app) as url, httpx.AsyncClient(base_url=url, timeout=10) as client:
        with pytest.raises(httpx.RemoteProtocolError):
            async with client.stream("POST", "/stream-fails", json={}) as response:
                assert response.status_code == 200
                async for _ in response.aiter_bytes():
                    pass
        after = await client.post("/works", json={})
        assert after.status_code == 200
    assert len(ports) == 2 and ports[0] != ports[1], ports  # the cut stream's connection was not reused
