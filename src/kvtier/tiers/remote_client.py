"""The shared tier's connection: the redis-py client, and ``Guard``, which bounds what a
store that is slow or down costs (``kvtier.tiers.remote``).

Thread-safe: redis-py's clients pool their connections; ``Guard`` has a lock.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar
from urllib.parse import urlparse

from kvtier.config import RemoteConfig

log = logging.getLogger("kvtier.tiers.remote")

T = TypeVar("T")


def store_errors() -> tuple[type[BaseException], ...]:
    """What a call to the store raises when it is slow, down or refuses."""
    import redis

    return (redis.RedisError, OSError)


class Unavailable(RuntimeError):
    """The store did not answer (within the timeout, or at all); the tier is down."""


def connect(config: RemoteConfig) -> Any:
    """A redis-py client for ``config``: ``RedisCluster`` or ``Redis``, every call bounded
    by ``timeout_s``, one attempt per call (the tier's own back-off retries).

    Raises:
        ValueError: the URL or TLS options are unusable, or (``cluster=None``) the server
            could not be asked whether it is a cluster.
    """
    import redis
    from redis.backoff import NoBackoff
    from redis.cluster import RedisCluster
    from redis.retry import Retry

    options: dict[str, Any] = {
        "socket_timeout": config.timeout_s,
        "socket_connect_timeout": config.timeout_s,
    }
    if config.tls_ca_certs is not None:
        options["ssl_ca_certs"] = config.tls_ca_certs
    cluster = config.cluster
    if cluster is None:
        try:
            probe = redis.Redis.from_url(config.url, **options)
            try:
                cluster = int(probe.info("cluster").get("cluster_enabled", 0)) == 1
            finally:
                probe.close()
        except redis.RedisError as exc:
            raise ValueError(f"remote.url: cannot reach {_safe(config.url)}: {exc}") from exc
    if cluster:
        return RedisCluster.from_url(config.url, retry=Retry(NoBackoff(), 0), **options)
    return redis.Redis.from_url(config.url, retry=Retry(NoBackoff(), 0), **options)


def _safe(url: str) -> str:
    """``url`` without its password (for logs and errors)."""
    parts = urlparse(url)
    host = parts.hostname or "?"
    return f"{parts.scheme}://{host}:{parts.port or 6379}"


class Guard:
    """Runs calls to one store: a call that raises (slow, refused, cluster down, no
    quorum) marks the store down for ``retry_after_s``, and calls in that window raise
    ``Unavailable`` at once, without touching the network; the next call after it tries
    again. One warning when the store goes down and one when a call succeeds again.

    Args:
        url: the store (logged without its password).
        retry_after_s: how long a failure keeps the store down.
        on_error: called once per failed call (the tier counts it).
    """

    def __init__(self, url: str, retry_after_s: float, on_error: Callable[[], None]) -> None:
        self.url, self.retry_after_s, self.on_error = _safe(url), retry_after_s, on_error
        self._errors = store_errors()
        self._lock = threading.Lock()
        self._down_until = 0.0  # monotonic; calls before it are skipped
        self._down = False

    @property
    def available(self) -> bool:
        """False while the store is down (a call failed less than ``retry_after_s`` ago)."""
        return time.monotonic() >= self._down_until

    def call(self, fn: Callable[[], T]) -> T:
        """Run one call; raises ``Unavailable`` (at once while the store is down)."""
        if time.monotonic() < self._down_until:
            raise Unavailable("the shared tier is down")
        try:
            result = fn()
        except self._errors as exc:
            self.on_error()
            with self._lock:
                self._down_until = time.monotonic() + self.retry_after_s
                first, self._down = not self._down, True
            if first:
                log.warning(
                    "remote tier %s: %s: %s; its chunks are recomputed until it answers "
                    "again (retrying every %.1f s)",
                    self.url,
                    type(exc).__name__,
                    exc,
                    self.retry_after_s,
                )
            raise Unavailable(str(exc)) from exc
        if self._down:
            with self._lock:
                back, self._down = self._down, False
            if back:
                log.warning("remote tier %s: answering again", self.url)
        return result
