"""The OpenAI-compatible HTTP app of one engine: routes, auth, limits and error mapping."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ValidationError

from pdserve.engine.frontend.async_llm import AsyncLLM
from pdserve.engine.frontend.mp_client import EngineDeadError
from pdserve.engine.server.errors import APIError, error_body, error_response
from pdserve.engine.server.metrics import EngineMetrics
from pdserve.engine.server.protocol import ChatCompletionRequest, CompletionRequest
from pdserve.engine.server.serving import Serving, new_request_id

log = logging.getLogger("pdserve.server")

DEFAULT_MAX_BODY_BYTES = 8 << 20


@dataclass
class ServerSettings:
    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES


class LimitsAndAuth:
    """ASGI middleware: refuse bodies over the limit (413) and, on /v1, requests without the key (401).

    Plain ASGI rather than a Starlette BaseHTTPMiddleware, which would buffer streaming responses.
    """

    def __init__(self, app: Any, settings: ServerSettings) -> None:
        self.app = app
        self.settings = settings

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        if self.settings.api_key and scope["path"].startswith("/v1"):
            if headers.get("authorization", "") != f"Bearer {self.settings.api_key}":
                return await error_response(401, "Invalid or missing API key.", code="invalid_api_key")(scope, receive, send)
        limit = self.settings.max_body_bytes
        declared = headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            return await self._too_large(scope, receive, send, int(declared))
        received = 0
        rejected = False

        async def limited_receive() -> dict:
            nonlocal received, rejected
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    rejected = True
                    raise _BodyTooLarge(received)
            return message

        try:
            await self.app(scope, limited_receive, send)
        except _BodyTooLarge as exc:
            await self._too_large(scope, receive, send, exc.size)

    async def _too_large(self, scope: dict, receive: Callable, send: Callable, size: int) -> None:
        message = f"Request body too large: {size} bytes; the limit is {self.settings.max_body_bytes} bytes."
        await error_response(413, message, code="request_too_large")(scope, receive, send)


class _BodyTooLarge(Exception):
    def __init__(self, size: int) -> None:
        self.size = size


async def parse_body(request: Request, model: type[BaseModel]) -> Any:
    raw = await request.body()
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise APIError(400, f"The request body is not valid UTF-8: {exc.reason} at byte {exc.start}.") from None
    except json.JSONDecodeError as exc:
        raise APIError(400, f"The request body is not valid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno}).") from None
    if not isinstance(data, dict):
        raise APIError(400, "The request body must be a JSON object.")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise APIError(400, f"Invalid request: {where}: {first['msg']}", param=str(first["loc"][0]) if first["loc"] else None) from None


def disconnect_watcher(request: Request) -> Callable[[], Awaitable[None]]:
    async def wait() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return
    return wait


def build_app(engine: AsyncLLM, settings: ServerSettings | None = None) -> FastAPI:
    settings = settings or ServerSettings()
    app = FastAPI(title="pdserve", docs_url=None, redoc_url=None)
    metrics = EngineMetrics(engine.model_name)
    engine.stats_listeners.append(metrics.observe)
    serving = Serving(engine)
    app.state.engine = engine
    app.state.metrics = metrics
    started = int(time.time())

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param, exc.code)

    @app.exception_handler(EngineDeadError)
    async def engine_dead(_: Request, exc: EngineDeadError) -> JSONResponse:
        return error_response(503, f"The engine is not running: {exc}", code="engine_dead")

    @app.exception_handler(Exception)
    async def unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return error_response(500, f"Internal error: {type(exc).__name__}: {exc}")

    async def respond(result: Any) -> Response:
        if isinstance(result, dict):
            return JSONResponse(result)
        return StreamingResponse(result, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    def check_alive() -> None:
        if engine.errored:
            raise EngineDeadError(str(engine.dead_error or engine.client.dead_reason))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        check_alive()
        body = await parse_body(request, CompletionRequest)
        request_id = request.headers.get("x-request-id") or new_request_id("cmpl")
        return await respond(await serving.completions(body, request_id, disconnect_watcher(request)))

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        check_alive()
        body = await parse_body(request, ChatCompletionRequest)
        request_id = request.headers.get("x-request-id") or new_request_id("chatcmpl")
        return await respond(await serving.chat(body, request_id, disconnect_watcher(request)))

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        mc = engine.config.model
        return {"object": "list", "data": [{"id": engine.model_name, "object": "model", "created": started,
                                            "owned_by": "pdserve", "root": mc.path, "max_model_len": mc.max_model_len}]}

    @app.get("/health")
    async def health() -> Response:
        if engine.errored:
            return JSONResponse(error_body(503, "The engine is not running.", code="engine_dead"), status_code=503)
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version() -> dict[str, str]:
        from importlib.metadata import PackageNotFoundError, version as pkg_version

        try:
            return {"version": pkg_version("pdserve")}
        except PackageNotFoundError:
            return {"version": "unknown"}

    return LimitsAndAuth(app, settings)  # type: ignore[return-value]
