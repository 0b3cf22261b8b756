"""The OpenAI-compatible HTTP API over an ``Engine``.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (``stream=true`` sends
server-sent events in OpenAI's chunk format, ending with ``data: [DONE]``), ``GET
/v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus text). With an API key, every
``/v1`` route needs ``Authorization: Bearer <key>``; ``/health`` and ``/metrics`` stay open
for probes and scrapers.

The app does not own the engine: whoever created the engine closes it (``kvtier serve``
does so after uvicorn has stopped, draining in-flight requests).
"""

from __future__ import annotations

import hmac
import json
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.types import ASGIApp, Receive, Scope, Send

from kvtier import __version__
from kvtier.engine import Completion, Engine, FinishReason, RequestHandle
from kvtier.server import errors
from kvtier.server.errors import APIError, error_response
from kvtier.server.metrics import registry_for
from kvtier.server.protocol import (
    DEFAULT_COMPLETION_TOKENS,
    ChatCompletionRequest,
    CompletionRequest,
    chat_body,
    chat_chunk,
    completion_body,
    completion_chunk,
    new_id,
    usage_body,
    usage_chunk,
)

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def create_app(engine: Engine, model_name: str, api_key: str | None = None) -> FastAPI:
    """A FastAPI app serving ``engine`` under the model name ``model_name``.

    Args:
        engine: the engine (started; the caller closes it).
        model_name: the ``model`` value clients must send, listed by ``/v1/models``.
        api_key: when set, ``/v1`` routes need ``Authorization: Bearer <api_key>``.
    """
    app = FastAPI(title="kvtier", version=__version__, docs_url=None, redoc_url=None)
    errors.install(app)
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    registry = registry_for(engine)
    created = int(time.time())

    def check_model(name: str) -> None:
        if name != model_name:
            raise APIError(
                404,
                f"model {name!r} does not exist; this server serves {model_name!r} "
                "(see /v1/models)",
                "model",
                "model_not_found",
            )

    @app.get("/health")
    async def health() -> JSONResponse:
        if engine.closed:
            return JSONResponse({"status": "shutting down"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        card = {
            "id": model_name,
            "object": "model",
            "created": created,
            "owned_by": "kvtier",
            "max_model_len": engine.max_model_len,
        }
        return JSONResponse({"object": "list", "data": [card]})

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest) -> Response:
        check_model(body.model)
        prompt = body.single_prompt()
        ids = engine.encode(prompt) if isinstance(prompt, str) else prompt
        max_tokens = body.max_tokens if body.max_tokens is not None else DEFAULT_COMPLETION_TOKENS
        request_id = new_id("cmpl")
        handle = engine.submit(ids, body.params(max_tokens), request_id)
        if body.stream:

            def chunk(text: str, reason: FinishReason | None) -> dict[str, Any]:
                return completion_chunk(request_id, model_name, text, reason)

            usage = (model_name, "text_completion") if body.include_usage else None
            events = _stream(handle, chunk, None, usage)
            return StreamingResponse(events, media_type="text/event-stream", headers=SSE_HEADERS)
        return JSONResponse(completion_body(request_id, model_name, await _collect(handle)))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest) -> Response:
        check_model(body.model)
        ids = engine.encode_chat([m.as_template_message() for m in body.messages])
        max_tokens = body.max_completion_tokens or body.max_tokens
        if max_tokens is None:  # OpenAI's default: the rest of the context
            max_tokens = max(1, engine.max_model_len - len(ids))
        request_id = new_id("chatcmpl")
        handle = engine.submit(ids, body.params(max_tokens), request_id)
        if body.stream:

            def chunk(text: str, reason: FinishReason | None) -> dict[str, Any]:
                delta = {"content": text} if text else {}
                return chat_chunk(request_id, model_name, delta, reason)

            first = chat_chunk(request_id, model_name, {"role": "assistant", "content": ""}, None)
            usage = (model_name, "chat.completion.chunk") if body.include_usage else None
            events = _stream(handle, chunk, first, usage)
            return StreamingResponse(events, media_type="text/event-stream", headers=SSE_HEADERS)
        return JSONResponse(chat_body(request_id, model_name, await _collect(handle)))

    return app


async def _collect(handle: RequestHandle) -> Completion:
    """Wait for a request to finish without blocking the event loop."""
    token_ids: list[int] = []
    parts: list[str] = []
    reason: FinishReason | None = None
    try:
        async with aclosing(handle.events()) as events:
            async for event in events:
                if event.token_id is not None:
                    token_ids.append(event.token_id)
                parts.append(event.text)
                reason = event.finish_reason
    except Exception as exc:  # raised by the engine for this request; it serves on
        raise APIError(500, f"generation failed: {exc}", None, "generation_failed") from exc
    request = handle.request
    return Completion(
        request.request_id,
        list(request.prompt_ids),
        token_ids,
        "".join(parts),
        reason,
        handle.reused_tokens,
    )


async def _stream(
    handle: RequestHandle,
    chunk: Callable[[str, FinishReason | None], dict[str, Any]],
    first: dict[str, Any] | None,
    usage_object: tuple[str, str] | None,
) -> AsyncIterator[str]:
    """Server-sent events for one request; cancels it if the client goes away.

    ``usage_object`` is ``(model name, chunk object type)`` when the client asked for a
    final usage chunk (``stream_options.include_usage``).
    """
    request_id = handle.request_id
    generated = 0
    try:
        if first is not None:
            yield _sse(first)
        async with aclosing(handle.events()) as events:
            async for event in events:
                generated += event.token_id is not None
                # One chunk per token, even when its text is still empty (a partial UTF-8
                # character): clients can count and time every token.
                yield _sse(chunk(event.text, event.finish_reason))
        if usage_object is not None:
            usage = usage_body(len(handle.request.prompt_ids), generated, handle.reused_tokens)
            yield _sse(usage_chunk(request_id, *usage_object, usage))
        yield "data: [DONE]\n\n"
    except Exception as exc:  # the engine failed mid-stream: say so in the stream, then end
        error = {"message": f"generation failed: {exc}", "type": "server_error"}
        yield _sse({"error": {**error, "param": None, "code": "generation_failed"}})
        yield "data: [DONE]\n\n"
    finally:
        handle.cancel()  # a no-op when finished; stops generation for a vanished client


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


class APIKeyMiddleware:
    """Rejects ``/v1`` requests without ``Authorization: Bearer <api_key>`` (401)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                message = (
                    "missing or invalid API key; send it as 'Authorization: Bearer <key>'"
                    if given
                    else "this server needs an API key: send 'Authorization: Bearer <key>'"
                )
                response = error_response(401, message, None, "invalid_api_key")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
