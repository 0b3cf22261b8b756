"""ASGI middleware that runs before any route: the body-size cap and the API keys.

Both answer with OpenAI-shaped errors without reading more of the request than they need,
so an oversized or unauthenticated request costs the server next to nothing.
"""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvtier.server.config import ServerConfig
from kvtier.server.errors import error_response

TENANT_SCOPE_KEY = "kvtier.tenant"
"""Where ``APIKeyMiddleware`` leaves the caller's tenant salt in the ASGI scope."""


class BodyLimitMiddleware:
    """Refuses request bodies over ``max_body_bytes`` with a 413.

    A ``Content-Length`` over the cap is refused before a byte of the body is read; a body
    without one (chunked) is read up to the cap and refused once it passes it. Bodies
    within the cap are handed on unchanged (buffered: at most the cap per request).
    """

    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body_bytes):
            await self._refuse(scope, receive, send)
            return
        parts: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return
            body = message.get("body", b"")
            size += len(body)
            if size > self.max_body_bytes:
                await self._refuse(scope, receive, send)
                return
            parts.append(body)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(parts), "more_body": False}
            return await receive()  # after the body: the disconnect, when it comes

        await self.app(scope, replay, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        message = (
            f"the request body is larger than this server accepts ({self.max_body_bytes} "
            "bytes; see kvtier serve --max-body-mb)"
        )
        response = error_response(413, message, None, "request_too_large")
        response.headers["Connection"] = "close"  # do not read the rest of the body
        await response(scope, receive, send)


class APIKeyMiddleware:
    """Rejects ``/v1`` requests (and ``/metrics`` when configured) without
    ``Authorization: Bearer <key>`` for one of the accepted keys (401).

    Leaves the key's tenant salt (``ServerConfig.tenant_of``) in ``scope[TENANT_SCOPE_KEY]``.
    """

    def __init__(self, app: ASGIApp, config: ServerConfig) -> None:
        self.app = app
        self.config = config
        self.expected = [(f"Bearer {k}".encode(), config.tenant_of(k)) for k in config.api_keys]

    def _guarded(self, path: str) -> bool:
        return path.startswith("/v1") or (self.config.metrics_need_key and path == "/metrics")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self._guarded(scope["path"]):
            given = dict(scope["headers"]).get(b"authorization", b"")
            tenant: str | None = None
            for expected, salt in self.expected:  # compare against every key: no early out
                if hmac.compare_digest(given, expected):
                    tenant = salt
            if tenant is None:
                message = (
                    "missing or invalid API key; send it as 'Authorization: Bearer <key>'"
                    if given
                    else "this server needs an API key: send 'Authorization: Bearer <key>'"
                )
                response = error_response(401, message, None, "invalid_api_key")
                response.headers["WWW-Authenticate"] = "Bearer"
                await response(scope, receive, send)
                return
            scope[TENANT_SCOPE_KEY] = tenant
        await self.app(scope, receive, send)
