"""Errors in the OpenAI format: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

import uuid
from http import HTTPStatus

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestTooLargeError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, HTTPStatus(status).phrase.replace(" ", "") + "Error"),
                      "param": param, "code": code if code is not None else status}}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status)


def new_error_id() -> str:
    """The id a client quotes for a 500; the details stay in the server's log."""
    return uuid.uuid4().hex[:12]


async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
    """Starlette's own errors (no such route, a method the route lacks) in the OpenAI format, as every
    other error of the servers is, instead of FastAPI's {"detail": ...}."""
    if exc.status_code == 404:
        message = f"No route {request.url.path}."
    elif exc.status_code == 405:
        message = f"{request.method} is not allowed on {request.url.path}."
    else:
        message = str(exc.detail)
    response = error_response(exc.status_code, message)
    for name, value in (exc.headers or {}).items():  # 405's Allow
        response.headers[name] = value
    return response


def model_card(model_id: str, created: int, **extra: object) -> dict:
    return {"id": model_id, "object": "model", "created": created, "owned_by": "pdserve", **extra}


def unknown_model(model_id: str) -> APIError:
    return APIError(404, f"The model `{model_id}` does not exist.", param="model", code="model_not_found")


async def client_gone(_: Request, exc: Exception) -> Response:
    """A client that left while its body was read (starlette's ClientDisconnect): nobody is listening
    and nothing failed here, so no answer and no error in the log (it was an "unhandled error" with a
    traceback). 499 is nginx's "client closed request", for the access log."""
    return Response(status_code=499)
