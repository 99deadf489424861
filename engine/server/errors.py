"""Errors in the OpenAI format: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

import uuid
from http import HTTPStatus

from fastapi.responses import JSONResponse

_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
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
