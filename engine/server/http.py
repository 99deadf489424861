"""The HTTP edge shared by the engine server and the router: body limits, the API key, the
X-Request-ID echo, JSON body parsing with OpenAI-style errors, disconnect watching.

Nothing here imports torch or the engine: the router and coordinator start without them.
"""

from __future__ import annotations

import hmac
import json
import re
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from fastapi import Request
from pydantic import BaseModel, ValidationError

from pdserve.engine.internal_auth import HEADER as INTERNAL_HEADER, header_matches
from pdserve.engine.server.errors import APIError, error_response

DEFAULT_MAX_BODY_BYTES = 8 << 20


@dataclass
class ServerSettings:
    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    # The deployment's internal key (pdserve.engine.internal_auth): it also opens every route, so a
    # router or picker reaches engines that have an --api-key without holding the clients' key.
    internal_key: bytes | None = None
    # /metrics is open by default (Prometheus scrapers rarely hold an API key); this closes it too.
    metrics_require_key: bool = False

    def is_open(self, path: str) -> bool:
        """Whether a route answers without the API key: liveness probes and, unless asked, metrics."""
        return path == "/health" or (path == "/metrics" and not self.metrics_require_key)


class LimitsAndAuth:
    """ASGI middleware: refuse bodies over the limit (413) and, with an API key, requests without it
    on every route but /health (and /metrics unless `metrics_require_key`) (401).

    Plain ASGI rather than a Starlette BaseHTTPMiddleware, which would buffer streaming responses.
    """

    def __init__(self, app: Any, settings: ServerSettings) -> None:
        self.app = app
        self.settings = settings

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        client_id = headers.get("x-request-id")
        if client_id is not None:
            send = _echo_request_id(send, client_id.encode("latin-1"))
        if self.settings.api_key and not self.settings.is_open(scope["path"]) and not self._authorized(headers):
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

        answered = False

        async def tracked_send(message: dict) -> None:
            nonlocal answered
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                answered = True
            await send(message)

        try:
            await self.app(scope, limited_receive, tracked_send)
        except _BodyTooLarge as exc:
            await self._too_large(scope, receive, send, exc.size)
        except Exception:
            # Starlette raises an unhandled error on after the app's handler has logged it and sent the
            # 500; uvicorn then closed the connection, and a client's next request on it (a pooled
            # keep-alive one) was reset. Once the answer is whole the connection can serve the next;
            # an answer cut short (a stream) must still end the connection.
            if not answered:
                raise

    def _authorized(self, headers: dict[str, str]) -> bool:
        # Constant time: how much of a guess matches must not show in how long the answer takes.
        given = headers.get("authorization", "").encode("latin-1")
        if hmac.compare_digest(given, f"Bearer {self.settings.api_key}".encode()):
            return True
        return header_matches(headers.get(INTERNAL_HEADER.lower()), self.settings.internal_key)

    async def _too_large(self, scope: dict, receive: Callable, send: Callable, size: int) -> None:
        message = f"Request body too large: {size} bytes; the limit is {self.settings.max_body_bytes} bytes."
        await error_response(413, message, code="request_too_large")(scope, receive, send)


def _echo_request_id(send: Callable, value: bytes) -> Callable:
    """The client's X-Request-ID goes back on the response, for its own correlation. The engine never
    uses it as a request id: two clients (or retries) sending the same one must not collide."""
    async def send_with_id(message: dict) -> None:
        if message["type"] == "http.response.start":
            kept = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"x-request-id"]
            message = {**message, "headers": [*kept, (b"x-request-id", value)]}
        await send(message)
    return send_with_id


class _BodyTooLarge(APIError):
    """Raised from inside the body stream: a route reading the body answers 413 through the app's
    APIError handler; outside a route the middleware answers it."""

    def __init__(self, size: int) -> None:
        super().__init__(413, f"Request body too large: more than {size - 1} bytes.", code="request_too_large")
        self.size = size


# A JSON escape of a UTF-16 surrogate: only then can a decoded string hold a lone one.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


async def parse_body(request: Request, model: type[BaseModel]) -> Any:
    raw = await request.body()
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise APIError(400, f"The request body is not valid UTF-8: {exc.reason} at byte {exc.start}.") from None
    except json.JSONDecodeError as exc:
        raise APIError(400, f"The request body is not valid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno}).") from None
    except RecursionError:
        raise APIError(400, "The request body is nested too deeply.") from None
    except ValueError:  # past JSONDecodeError: an integer of more digits than Python converts (4300)
        raise APIError(400, "The request body holds a number too long to read.") from None
    if _SURROGATE_ESCAPE.search(raw):
        try:  # a lone surrogate decodes, then breaks the tokenizer: refuse it here
            json.dumps(data, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise APIError(400, "The request body holds an unpaired UTF-16 surrogate escape (e.g. \\ud800).") from None
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
