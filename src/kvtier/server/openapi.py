"""The OpenAPI document at ``/openapi.json``, edited to say what the server really answers.

FastAPI derives the request bodies from the pydantic models in ``protocol``, but knows
nothing of the handlers in ``errors`` or of the bodies the routes build as dicts; left
alone it would promise a 422 ``HTTPValidationError`` that never comes and leave every
response schema empty. ``install_openapi`` replaces that with:

| route | statuses |
| --- | --- |
| ``POST /v1/completions``, ``/v1/chat/completions`` | 200, 400, 401*, 404, 413, 429, 500, 503 |
| ``GET /v1/models`` | 200, 401*, 500 |
| ``GET /health`` | 200, 503 (both ``{"status": ...}``), 500 |
| ``GET /metrics`` | 200 (Prometheus text), 401**, 500 |

(*) only with an API key, which the document then declares as a bearer security scheme;
(**) only when ``/metrics`` needs the key too.
A generation's 200 is JSON or, with ``stream: true``, ``text/event-stream``; a 429 carries
``Retry-After``. Every error body is OpenAI's ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import copy
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from prometheus_client import CONTENT_TYPE_LATEST

# Prometheus's exposition format: the media type and its version, without the charset.
METRICS_MEDIA_TYPE = "; ".join(
    part for part in CONTENT_TYPE_LATEST.split("; ") if not part.startswith("charset")
)

SECURITY_SCHEME = "bearer"
GENERATION_ROUTES = {"/v1/completions": "Completion", "/v1/chat/completions": "ChatCompletion"}


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _object(required: dict[str, Any], **optional: Any) -> dict[str, Any]:
    """An object schema with these required properties (and optional ones); extra keys allowed."""
    return {"type": "object", "required": list(required), "properties": {**required, **optional}}


_STRING = {"type": "string"}
_INTEGER = {"type": "integer"}
_NULL_OR_STRING = {"type": ["string", "null"]}
_FINISH_REASON = {"enum": ["stop", "length", "cancelled", None]}
_NUMBER = {"type": "number"}
_TOKEN_LOGPROB = _object(
    {"token": _STRING, "logprob": _NUMBER, "bytes": {"type": "array", "items": _INTEGER}}
)
# /v1/completions' legacy columns and chat's per-token entries (see kvtier.server.logprobs).
_COMPLETION_LOGPROBS = {
    "anyOf": [
        {"type": "null"},
        _object(
            {
                "tokens": {"type": "array", "items": _STRING},
                "token_logprobs": {"type": "array", "items": _NUMBER},
                "top_logprobs": {
                    "type": "array",
                    "items": {"type": "object", "additionalProperties": _NUMBER},
                },
                "text_offset": {"type": "array", "items": _INTEGER},
            }
        ),
    ]
}
_CHAT_LOGPROBS = {
    "anyOf": [
        {"type": "null"},
        _object(
            {
                "content": {
                    "type": "array",
                    "items": {
                        "allOf": [
                            _TOKEN_LOGPROB,
                            _object({"top_logprobs": {"type": "array", "items": _TOKEN_LOGPROB}}),
                        ]
                    },
                }
            }
        ),
    ]
}

_USAGE = _object(
    {"prompt_tokens": _INTEGER, "completion_tokens": _INTEGER, "total_tokens": _INTEGER},
    prompt_tokens_details=_object({"cached_tokens": _INTEGER}),
)


def _response_body(
    obj: str, choice: dict[str, Any], usage: dict[str, Any] | None
) -> dict[str, Any]:
    head = {"id": _STRING, "object": {"const": obj}, "created": _INTEGER, "model": _STRING}
    choices = {"type": "array", "items": choice}
    if usage is None:  # a stream chunk: the last one (include_usage) has no choices, and usage
        return _object({**head, "choices": choices}, usage=_ref("Usage"))
    return _object({**head, "choices": choices, "usage": usage})


def _choice(logprobs: dict[str, Any], **fields: Any) -> dict[str, Any]:
    return _object(
        {"index": _INTEGER, **fields, "logprobs": logprobs, "finish_reason": _FINISH_REASON}
    )


COMPONENTS: dict[str, Any] = {
    "ErrorResponse": _object(
        {
            "error": _object(
                {
                    "message": _STRING,
                    "type": _STRING,
                    "param": _NULL_OR_STRING,
                    "code": _NULL_OR_STRING,
                }
            )
        }
    ),
    "Usage": _USAGE,
    "Completion": _response_body(
        "text_completion", _choice(_COMPLETION_LOGPROBS, text=_STRING), _ref("Usage")
    ),
    "CompletionChunk": _response_body(
        "text_completion", _choice(_COMPLETION_LOGPROBS, text=_STRING), None
    ),
    "ChatCompletion": _response_body(
        "chat.completion",
        _choice(
            _CHAT_LOGPROBS, message=_object({"role": {"const": "assistant"}, "content": _STRING})
        ),
        _ref("Usage"),
    ),
    "ChatCompletionChunk": _response_body(
        "chat.completion.chunk",
        _choice(_CHAT_LOGPROBS, delta=_object({}, role={"const": "assistant"}, content=_STRING)),
        None,
    ),
    "ModelList": _object(
        {
            "object": {"const": "list"},
            "data": {
                "type": "array",
                "items": _object(
                    {
                        "id": _STRING,
                        "object": {"const": "model"},
                        "created": _INTEGER,
                        "owned_by": _STRING,
                    },
                    max_model_len=_INTEGER,
                ),
            },
        }
    ),
    "Health": _object({"status": _STRING}),
}


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _error(description: str) -> dict[str, Any]:
    return _json(_ref("ErrorResponse"), description)


def _event_stream(chunk: str) -> dict[str, Any]:
    """Server-sent events, as FastAPI documents its own: ``itemSchema`` describes one event.

    Each event's ``data`` is a JSON chunk (or an error object, if generation fails
    mid-stream), and the last is ``[DONE]``.
    """
    data = {
        "type": "string",
        "if": {"const": "[DONE]"},
        "else": {
            "contentMediaType": "application/json",
            "contentSchema": {"anyOf": [_ref(chunk), _ref("ErrorResponse")]},
        },
    }
    event = _object(
        {"data": data}, event=_STRING, id=_STRING, retry={"type": "integer", "minimum": 0}
    )
    return {"itemSchema": event}


QUEUE_FULL = {
    **_error("The engine's queue is full; retry after the number of seconds in Retry-After."),
    "headers": {
        "Retry-After": {
            "description": "Seconds to wait before retrying.",
            "required": True,
            "schema": {"type": "string", "pattern": r"^\d+$"},
        }
    },
}


def _guarded(path: str, api_key: bool, metrics_need_key: bool) -> bool:
    """Whether ``path`` needs the API key (as ``guard.APIKeyMiddleware`` decides)."""
    return api_key and (path.startswith("/v1") or (metrics_need_key and path == "/metrics"))


def _responses(path: str, guarded: bool) -> dict[str, Any]:
    """What each route answers (see the module's table)."""
    responses: dict[str, Any]
    if path in GENERATION_ROUTES:
        body = GENERATION_ROUTES[path]
        ok = _json(_ref(body), "The completion, or with `stream: true` its chunks as events.")
        ok["content"]["text/event-stream"] = _event_stream(f"{body}Chunk")
        responses = {
            "200": ok,
            "400": _error("Invalid request: the message names the field and what it accepts."),
            "404": _error("No such model (see /v1/models)."),
            "413": _error("The request body is too large."),
            "429": copy.deepcopy(QUEUE_FULL),
            "503": _error("The server is shutting down or its engine has stopped."),
        }
    elif path == "/v1/models":
        responses = {"200": _json(_ref("ModelList"), "The model this server serves.")}
    elif path == "/health":
        responses = {
            "200": _json(_ref("Health"), "Serving."),
            "503": _json(_ref("Health"), "Shutting down."),
        }
    elif path == "/metrics":
        schema = {"type": "string"}
        text = {
            "description": "Prometheus metrics.",
            "content": {METRICS_MEDIA_TYPE: {"schema": schema}},
        }
        responses = {"200": text}
    else:  # a route this module does not know yet: keep FastAPI's 200, fix the errors
        responses = {}
    if guarded:
        responses["401"] = {
            **_error("Missing or invalid API key."),
            "headers": {"WWW-Authenticate": {"required": True, "schema": {"const": "Bearer"}}},
        }
    responses["500"] = _error("An internal error (the server keeps serving).")
    return responses


def document(
    schema: dict[str, Any], *, api_key: bool, metrics_need_key: bool = False
) -> dict[str, Any]:
    """Edit FastAPI's generated ``schema`` in place to match the server, and return it."""
    components = schema.setdefault("components", {})
    schemas = components.setdefault("schemas", {})
    for path, operations in schema.get("paths", {}).items():
        for operation in operations.values():
            responses = operation.setdefault("responses", {})
            responses.pop("422", None)  # FastAPI's; errors.install answers 400 instead
            guarded = _guarded(path, api_key, metrics_need_key)
            responses.update(_responses(path, guarded))
            if guarded:
                operation["security"] = [{SECURITY_SCHEME: []}]
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    schemas.update(copy.deepcopy(COMPONENTS))
    if api_key:
        components["securitySchemes"] = {
            SECURITY_SCHEME: {"type": "http", "scheme": "bearer", "description": "the API key"}
        }
    return schema


def install_openapi(app: FastAPI, *, api_key: bool = False, metrics_need_key: bool = False) -> None:
    """Serve ``document``'s version of the app's OpenAPI document (built once, on first use).

    Args:
        app: the app; call this after its routes are added or before (the document is
            built on the first request for it).
        api_key: whether ``/v1`` routes need ``Authorization: Bearer <key>``.
        metrics_need_key: whether ``/metrics`` needs it too.
    """

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            generated = get_openapi(
                title=app.title,
                version=app.version,
                openapi_version=app.openapi_version,
                summary=app.summary,
                description=app.description,
                routes=app.routes,
                servers=app.servers,
                separate_input_output_schemas=app.separate_input_output_schemas,
            )
            app.openapi_schema = document(
                generated, api_key=api_key, metrics_need_key=metrics_need_key
            )
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
