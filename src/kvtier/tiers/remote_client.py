"""The shared tier's connection: the redis-py client, and ``Guard``, which bounds what a
store that is slow or down costs (``kvtier.tiers.remote``).

Thread-safe: redis-py's clients pool their connections; ``Guard`` has a lock.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, NoReturn, TypeVar
from urllib.parse import urlparse

from kvtier.config import RemoteConfig

log = logging.getLogger("kvtier.tiers.remote")

T = TypeVar("T")
_WORKERS = 8  # calls in flight at once (the link's worker, the writer, lookups, …)


def store_errors() -> tuple[type[BaseException], ...]:
    """What a call to the store raises when it is slow, down or refuses."""
    import redis
    from redis.exceptions import RedisClusterException

    return (redis.RedisError, RedisClusterException, OSError)


class Unavailable(RuntimeError):
    """The store did not answer (within the timeout, or at all); the tier is down."""


def connect(config: RemoteConfig) -> Any:
    """A redis-py client for ``config``: ``RedisCluster`` or ``Redis``, every call bounded
    by ``timeout_s``, one attempt per call (the tier's own back-off retries).

    With ``cluster=None`` the server is asked first (``INFO cluster``).

    Raises:
        what ``store_errors`` names: the store cannot be reached or refuses (AUTH, TLS).
    """
    import redis
    from redis.backoff import NoBackoff
    from redis.cluster import ClusterNode, RedisCluster
    from redis.retry import Retry

    options: dict[str, Any] = {
        "socket_timeout": config.timeout_s,
        "socket_connect_timeout": config.timeout_s,
    }
    if config.tls_ca_certs is not None:
        options["ssl_ca_certs"] = config.tls_ca_certs
    urls = node_urls(config.url)
    cluster = config.cluster
    if cluster is None:
        cluster = _is_cluster(urls, options)
    if cluster:
        others = [
            ClusterNode(u.hostname or "127.0.0.1", u.port or 6379) for u in map(urlparse, urls[1:])
        ]
        return RedisCluster.from_url(
            urls[0], startup_nodes=others, retry=Retry(NoBackoff(), 0), **options
        )
    return redis.Redis.from_url(urls[0], retry=Retry(NoBackoff(), 0), **options)


def ping_every_node(client: Any) -> None:
    """``PING`` every primary of a cluster (the one server otherwise): each gets its first
    connection now rather than in a request."""
    if hasattr(client, "get_primaries"):
        client.ping(target_nodes=client.PRIMARIES)
    else:
        client.ping()


def node_urls(url: str) -> list[str]:
    """One URL per node of ``redis://[auth@]host:port,host:port,…[/db]`` (a cluster's
    startup nodes: any one that answers leads the client to the others)."""
    scheme, _, rest = url.partition("://")
    auth, at, hosts = rest.rpartition("@")
    hosts, slash, path = hosts.partition("/")
    return [f"{scheme}://{auth}{at}{host}{slash}{path}" for host in hosts.split(",") if host]


def _is_cluster(urls: list[str], options: dict[str, Any]) -> bool:
    """Whether the first node that answers says ``cluster_enabled:1``."""
    import redis

    error: BaseException | None = None
    for url in urls:
        probe = redis.Redis.from_url(url, **options)
        try:
            return int(probe.info("cluster").get("cluster_enabled", 0)) == 1
        except redis.RedisError as exc:
            error = exc
        finally:
            probe.close()
    assert error is not None
    raise error


def safe_url(url: str) -> str:
    """``url`` without its credentials (for logs, errors and profiles)."""
    parts = [urlparse(u) for u in node_urls(url)]
    hosts = ",".join(f"{p.hostname or '?'}:{p.port or 6379}" for p in parts)
    return f"{parts[0].scheme}://{hosts}" if parts else "?"


class Guard:
    """Runs calls to one store within a deadline: a call that raises (refused, cluster
    down, no quorum) or has not answered after ``timeout_s`` marks the store down for
    ``retry_after_s``, and calls in that window raise ``Unavailable`` at once, without
    touching the network; the next call after it tries again. One warning when the store
    goes down and one when a call succeeds again.

    Calls run on a small pool of the guard's threads and the caller waits at most
    ``timeout_s``: a client that retries or rediscovers a cluster on its own (redis-py does
    after a timeout, node by node) cannot hold a request longer. A call given up on
    finishes in the background; its result is dropped.

    Args:
        url: the store (logged without its password).
        timeout_s: the most a caller waits for one call.
        retry_after_s: how long a failure keeps the store down.
        on_error: called once per failed call (the tier counts it).
    """

    def __init__(
        self, url: str, timeout_s: float, retry_after_s: float, on_error: Callable[[], None]
    ) -> None:
        self.url, self.retry_after_s, self.on_error = safe_url(url), retry_after_s, on_error
        self.timeout_s = timeout_s
        self._errors: tuple[type[BaseException], ...] = (*store_errors(), TimeoutError)
        self._lock = threading.Lock()
        self._closed = False
        self._down_until = 0.0  # monotonic; calls before it are skipped
        self._down = False
        self._pool = ThreadPoolExecutor(_WORKERS, thread_name_prefix="kvtier-remote")
        self._running = 0  # calls on the pool now (given-up ones included)

    def close(self) -> None:
        """Stop taking calls (later ones time out at once); calls still running finish
        in the background."""
        with self._lock:
            self._closed = True
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _submit(self, fn: Callable[[], T]) -> Future[T]:
        """``fn`` on the pool (raises ``TimeoutError`` when closed or every worker waits)."""
        with self._lock:
            if self._closed:
                raise TimeoutError("the tier is closed")
            if self._running >= _WORKERS:  # every worker waits on a store that hangs
                raise TimeoutError("every call to the store is still waiting")
            self._running += 1

        def tracked() -> T:
            try:
                return fn()
            finally:
                with self._lock:
                    self._running -= 1

        return self._pool.submit(tracked)

    @property
    def available(self) -> bool:
        """False while the store is down (a call failed less than ``retry_after_s`` ago)."""
        return time.monotonic() >= self._down_until

    def call(self, fn: Callable[[], T]) -> T:
        """Run one call; raises ``Unavailable`` (at once while the store is down)."""
        return self.wait(self.start(fn))

    def start(self, fn: Callable[[], T]) -> Future[T]:
        """Start one call on the pool without waiting (``wait`` gets its result); raises
        ``Unavailable`` at once while the store is down."""
        if time.monotonic() < self._down_until:
            raise Unavailable("the shared tier is down")
        try:
            return self._submit(fn)
        except TimeoutError as exc:
            self._failed(exc)

    def wait(self, future: Future[T]) -> T:
        """The result of a call ``start`` began, waited for at most ``timeout_s`` from now;
        raises ``Unavailable`` (and marks the store down) if it failed or did not answer,
        and at once if the store went down since and the call has not finished."""
        if not future.done() and time.monotonic() < self._down_until:
            raise Unavailable("the shared tier is down")
        try:
            try:
                result = future.result(timeout=self.timeout_s)
            except FutureTimeout:
                raise TimeoutError(f"no answer within {self.timeout_s:.2f} s") from None
        except self._errors as exc:
            self._failed(exc)
        if self._down:
            with self._lock:
                back, self._down = self._down, False
            if back:
                log.warning("remote tier %s: answering again", self.url)
        return result

    def _failed(self, exc: BaseException) -> NoReturn:
        """Count a failed call, mark the store down (one warning when it goes down) and
        raise ``Unavailable``."""
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
