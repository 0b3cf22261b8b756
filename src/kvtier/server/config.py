"""The HTTP server's own settings: limits checked before any work, keys and tenants."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvtier.config import MiB
from kvtier.validate import check_int

KEYS_ENV = "KVTIER_API_KEYS"
"""Environment variable with API keys, separated by commas (kept out of ``ps``)."""


@dataclass(frozen=True)
class ServerConfig:
    """What the server accepts, and from whom.

    Attributes:
        api_keys: accepted keys for ``Authorization: Bearer <key>`` on ``/v1`` routes;
            empty: no key needed.
        salt_by_key: each key is its own tenant: its requests reuse KV only from requests
            sent with the same key (on top of any per-request ``cache_salt``).
        metrics_need_key: ``/metrics`` needs a key too (``/health`` always stays open).
        max_body_bytes: request bodies above this are refused (413) before being read;
            None: 4 bytes per prompt character allowed (``max_prompt_chars``: UTF-8 of any
            text), at least 1 MiB (2 MiB for an 8K-token model). FastAPI parses the JSON
            on the event loop (about 50 ms per MiB of numbers on this machine), so the
            cap also bounds how long one body can stall it.
        max_prompt_chars: text prompts (all messages together, for chat) above this many
            characters are refused (400) before tokenizing; None: 64 per token of the
            model's context.
    """

    api_keys: tuple[str, ...] = ()
    salt_by_key: bool = False
    metrics_need_key: bool = False
    max_body_bytes: int | None = None
    max_prompt_chars: int | None = None

    def __post_init__(self) -> None:
        if any(not isinstance(k, str) or not k or k != k.strip() for k in self.api_keys):
            raise ValueError("api_keys: each key must be a non-empty string without spaces")
        if self.salt_by_key and not self.api_keys:
            raise ValueError("salt_by_key: needs at least one API key (--api-key-file)")
        if self.metrics_need_key and not self.api_keys:
            raise ValueError("metrics_need_key: needs at least one API key (--api-key-file)")
        check_int("max_body_bytes", self.max_body_bytes, 1, none="from the prompt cap")
        check_int("max_prompt_chars", self.max_prompt_chars, 1, none="64 per context token")

    def prompt_chars_limit(self, max_model_len: int) -> int:
        """The character cap on text prompts for a model of ``max_model_len`` tokens."""
        if self.max_prompt_chars is not None:
            return self.max_prompt_chars
        return 64 * max_model_len

    def body_bytes_limit(self, max_model_len: int) -> int:
        """The body-size cap for a model of ``max_model_len`` tokens."""
        if self.max_body_bytes is not None:
            return self.max_body_bytes
        return max(1 * MiB, 4 * self.prompt_chars_limit(max_model_len))

    def tenant_of(self, key: str) -> str:
        """The salt of an accepted key's tenant (empty unless ``salt_by_key``): a digest,
        so the key itself never reaches the tiers."""
        if not self.salt_by_key:
            return ""
        return "key:" + hashlib.sha256(key.encode()).hexdigest()[:32]


def read_api_keys(flags: Sequence[str], files: Sequence[str]) -> tuple[str, ...]:
    """API keys from ``--api-key`` flags, key files (one key per line, ``#`` comments) and
    the ``KVTIER_API_KEYS`` environment variable, in that order, without repeats.

    Raises:
        ValueError: a key file cannot be read, or holds no key.
    """
    keys: list[str] = list(flags)
    for name in files:
        path = Path(name)
        try:
            lines = path.read_text().splitlines()
        except OSError as exc:
            raise ValueError(f"--api-key-file: cannot read {path}: {exc.strerror}") from None
        found = [ln.strip() for ln in lines if ln.strip() and not ln.strip().startswith("#")]
        if not found:
            raise ValueError(f"--api-key-file: {path} holds no key (one key per line)")
        keys.extend(found)
    keys.extend(k.strip() for k in os.environ.get(KEYS_ENV, "").split(",") if k.strip())
    return tuple(dict.fromkeys(keys))
