"""The OpenAI-compatible HTTP server (``kvtier serve``); ``create_app`` builds the app."""

from __future__ import annotations

from typing import Any

__all__ = ["create_app"]


def __getattr__(name: str) -> Any:
    # Lazy, so `kvtier serve --help` answers before torch and transformers are imported.
    if name == "create_app":
        from kvtier.server.app import create_app

        return create_app
    raise AttributeError(f"module 'kvtier.server' has no attribute {name!r}")
