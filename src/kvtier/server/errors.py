"""Errors in OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``.

Every expected failure maps to a 4xx (or 503 while shutting down) with a message that
names the field and what it accepts; the server keeps serving after each.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvtier.engine import ContextLengthError, EngineClosedError, ParamError, QueueFullError
from kvtier.server.protocol import EXPECTED

_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    499: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}

# Pydantic's tags for union members, which appear in error locations after the field name.
_TYPE_TAGS = ("str", "int", "float", "bool", "list", "dict", "none")


class APIError(Exception):
    """An error response: HTTP status, message, and OpenAI's param and code."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code


def error_response(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> JSONResponse:
    body = {
        "error": {
            "message": message,
            "type": _TYPES.get(status, "invalid_request_error"),
            "param": param,
            "code": code,
        }
    }
    return JSONResponse(body, status_code=status)


def install(app: FastAPI) -> None:
    """Register the handlers that turn exceptions into OpenAI-shaped responses."""

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param, exc.code)

    @app.exception_handler(ParamError)
    async def param_error(request: Request, exc: ParamError) -> JSONResponse:
        code = "context_length_exceeded" if isinstance(exc, ContextLengthError) else None
        return error_response(400, str(exc), exc.param, code)

    @app.exception_handler(QueueFullError)
    async def queue_full(request: Request, exc: QueueFullError) -> JSONResponse:
        response = error_response(429, str(exc), None, "queue_full")
        response.headers["Retry-After"] = str(exc.retry_after_s)
        return response

    @app.exception_handler(EngineClosedError)
    async def closed(request: Request, exc: EngineClosedError) -> JSONResponse:
        return error_response(503, str(exc), None, "shutting_down")

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = describe_validation_error(exc.errors())
        return error_response(400, message, param, "invalid_value")

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}")

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        detail = exc.detail if isinstance(exc.detail, str) else "request failed"
        if exc.status_code == 404:
            detail = f"no route {request.method} {request.url.path}; see /v1/models"
        response = error_response(exc.status_code, detail)
        response.headers.update(exc.headers or {})  # e.g. a 405's Allow
        return response


def describe_validation_error(errors: Any) -> tuple[str, str | None]:
    """One actionable message for FastAPI's validation errors, and the field it names."""
    first: dict[str, Any] = next(iter(errors), {}) if errors else {}
    kind = first.get("type", "")
    loc = [part for part in first.get("loc", ()) if part != "body"]
    if kind == "json_invalid":
        detail = first.get("ctx", {}).get("error", "")
        return f"the request body is not valid JSON ({detail})", None
    if not loc:
        return "the request body must be a JSON object (Content-Type: application/json)", None
    param, union = _param_of(loc)
    if kind == "missing":
        return f"{param}: this field is required", param
    field_name = next((p for p in reversed(param.split(".")) if not p.endswith("]")), param)
    if union and field_name.split("[")[0] in EXPECTED:
        return f"{param}: must be {EXPECTED[field_name.split('[')[0]]}", param
    return f"{param}: {first.get('msg', 'invalid value')}", param


def _param_of(loc: list[Any]) -> tuple[str, bool]:
    """``["messages", 0, "content", "str"]`` -> ``("messages[0].content", True)``."""
    param = ""
    union = False
    for part in loc:
        if isinstance(part, int):
            param += f"[{part}]"
        elif "[" in part or part.lower() in _TYPE_TAGS or "-" in part:
            union = True
            break
        else:
            param += f".{part}" if param else part
    return param, union
