"""The OpenAI-compatible HTTP API over an ``Engine``.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (``stream=true`` sends
server-sent events in OpenAI's chunk format, ending with ``data: [DONE]``), ``GET
/v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus text). With API keys, every
``/v1`` route (and ``/metrics`` when configured) needs ``Authorization: Bearer <key>``;
``/health`` stays open for probes.

Before any work, a request is checked in this order: body size (413, unread), key (401),
JSON shape and every field's range (400 naming the field), prompt length in characters
(400); only then is a text prompt tokenized, off the event loop. A client that goes away
cancels its request, streaming or not, within one engine step.

The app does not own the engine: whoever created the engine closes it (``kvtier serve``
does so after uvicorn has stopped, draining in-flight requests).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvtier import __version__
from kvtier.engine import (
    Completion,
    Engine,
    ParamError,
    RequestHandle,
    TokenEvent,
    TokenLogprobs,
)
from kvtier.server import errors
from kvtier.server.config import ServerConfig
from kvtier.server.errors import APIError
from kvtier.server.guard import TENANT_SCOPE_KEY, APIKeyMiddleware, BodyLimitMiddleware
from kvtier.server.logprobs import CompletionLogprobs, chat_logprobs
from kvtier.server.metrics import registry_for
from kvtier.server.openapi import install_openapi
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


def create_app(engine: Engine, model_name: str, config: ServerConfig | None = None) -> FastAPI:
    """A FastAPI app serving ``engine`` under the model name ``model_name``.

    Args:
        engine: the engine (started; the caller closes it).
        model_name: the ``model`` value clients must send, listed by ``/v1/models``.
        config: keys, tenants and input limits (default: no key, default limits).
    """
    config = config or ServerConfig()
    app = FastAPI(title="kvtier", version=__version__, docs_url=None, redoc_url=None)
    errors.install(app)
    install_openapi(app, api_key=bool(config.api_keys), metrics_need_key=config.metrics_need_key)
    body_limit = config.body_bytes_limit(engine.max_model_len)
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=body_limit)
    if config.api_keys:
        app.add_middleware(APIKeyMiddleware, config=config)  # outermost: 401 before 413
    registry = registry_for(engine)
    created = int(time.time())
    max_chars = config.prompt_chars_limit(engine.max_model_len)

    def check_model(name: str) -> None:
        if name != model_name:
            raise APIError(
                404,
                f"model {name!r} does not exist; this server serves {model_name!r} "
                "(see /v1/models)",
                "model",
                "model_not_found",
            )

    def check_chars(param: str, chars: int) -> None:
        if chars > max_chars:
            raise ParamError(
                param,
                f"the prompt has {chars} characters, more than this server tokenizes "
                f"({max_chars}; see kvtier serve --max-prompt-chars)",
            )

    def salt_of(request: Request, cache_salt: str | None) -> str:
        """The request's tenant: its key's (when salting by key) and its own salt."""
        parts = (request.scope.get(TENANT_SCOPE_KEY, ""), cache_salt or "")
        return "|".join(parts) if any(parts) else ""

    @app.get("/health")
    async def health() -> JSONResponse:
        dead = engine.dead_reason
        if dead is not None:
            return JSONResponse({"status": "dead", "reason": dead}, status_code=503)
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
    async def completions(body: CompletionRequest, request: Request) -> Response:
        check_model(body.model)
        body.check()
        prompt = body.single_prompt()
        max_tokens = body.max_tokens if body.max_tokens is not None else DEFAULT_COMPLETION_TOKENS
        params = body.params(max_tokens)
        if isinstance(prompt, str):
            check_chars("prompt", len(prompt))
            ids = await asyncio.to_thread(engine.encode, prompt)
        else:
            ids = prompt
        request_id = new_id("cmpl")
        handle = engine.submit(ids, params, request_id, salt_of(request, body.cache_salt))
        logprobs = CompletionLogprobs(engine.token_text) if params.logprobs is not None else None
        if body.stream:

            def chunk(event: TokenEvent) -> dict[str, Any]:
                lp = _one(event)
                text_lp = logprobs.of(lp) if logprobs is not None and lp else None
                return completion_chunk(
                    request_id, model_name, event.text, event.finish_reason, text_lp
                )

            usage = (model_name, "text_completion") if body.include_usage else None
            events = _stream(handle, chunk, None, usage)
            return StreamingResponse(events, media_type="text/event-stream", headers=SSE_HEADERS)
        completion = await _collect_while_connected(handle, request)
        all_lp = logprobs.of(_all(completion)) if logprobs is not None else None
        return JSONResponse(completion_body(request_id, model_name, completion, all_lp))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        check_model(body.model)
        body.check()
        body.params(1)  # every field checked before the prompt is tokenized
        messages = [m.as_template_message() for m in body.messages]
        check_chars("messages", sum(len(m["content"]) for m in messages))
        ids = await asyncio.to_thread(engine.encode_chat, messages)
        max_tokens = body.max_completion_tokens or body.max_tokens
        if max_tokens is None:  # OpenAI's default: the rest of the context
            max_tokens = max(1, engine.max_model_len - len(ids))
        request_id = new_id("chatcmpl")
        params = body.params(max_tokens)
        handle = engine.submit(ids, params, request_id, salt_of(request, body.cache_salt))
        want_logprobs = params.logprobs is not None
        if body.stream:

            def chunk(event: TokenEvent) -> dict[str, Any]:
                delta = {"content": event.text} if event.text else {}
                lp = _one(event)
                chat_lp = chat_logprobs(lp, engine.token_text) if want_logprobs and lp else None
                return chat_chunk(request_id, model_name, delta, event.finish_reason, chat_lp)

            first = chat_chunk(request_id, model_name, {"role": "assistant", "content": ""}, None)
            usage = (model_name, "chat.completion.chunk") if body.include_usage else None
            events = _stream(handle, chunk, first, usage)
            return StreamingResponse(events, media_type="text/event-stream", headers=SSE_HEADERS)
        completion = await _collect_while_connected(handle, request)
        all_lp = chat_logprobs(_all(completion), engine.token_text) if want_logprobs else None
        return JSONResponse(chat_body(request_id, model_name, completion, all_lp))

    return app


def _one(event: TokenEvent) -> list[tuple[int, TokenLogprobs]]:
    """The event's token with its log-probabilities, when it carries both."""
    if event.token_id is None or event.logprobs is None:
        return []
    return [(event.token_id, event.logprobs)]


def _all(completion: Completion) -> list[tuple[int, TokenLogprobs]]:
    """Every generated token with its log-probabilities."""
    return list(zip(completion.token_ids, completion.logprobs or [], strict=False))


async def _collect_while_connected(handle: RequestHandle, request: Request) -> Completion:
    """Wait for a request to finish; cancel it if the client disconnects first.

    Raises:
        APIError: the engine failed this request (500), or the client went away (499, a
            response nobody receives).
    """
    collect = asyncio.ensure_future(_collect(handle))
    gone = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait((collect, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if collect.done():
        return collect.result()
    handle.cancel()  # the engine ends it at its next step
    collect.cancel()
    raise APIError(499, "the client closed the connection", None, "client_closed_request")


async def _disconnect(request: Request) -> None:
    """Return when the client disconnects (the body has been read: only that can come)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _collect(handle: RequestHandle) -> Completion:
    """Wait for a request to finish without blocking the event loop."""
    received: list[TokenEvent] = []
    try:
        async with aclosing(handle.events()) as events:
            async for event in events:
                received.append(event)
    except Exception as exc:  # raised by the engine for this request; it serves on
        raise APIError(500, f"generation failed: {exc}", None, "generation_failed") from exc
    return handle.completion_of(received)


async def _stream(
    handle: RequestHandle,
    chunk: Callable[[TokenEvent], dict[str, Any]],
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
                yield _sse(chunk(event))
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
