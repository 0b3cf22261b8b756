"""The scheduler side asks the worker side what kvtier holds: ``LookupServer``, ``LookupClient``.

vLLM runs its scheduler and its worker in different processes (the CPU backend does even
with one worker), and the tiers, the host tier above all, live with the worker, which loads
and saves the chunks. So the worker serves lookups on a Unix socket named by vLLM's
``engine_id`` (shared by both sides; on Linux in the abstract namespace, so no file is
left behind by a killed worker), and the scheduler asks it once per new request: the
answer is where the prompt's leading chunks are, exactly as the worker will find them.

Wire: each message is a 4-byte big-endian length and a JSON body. Ask ``{"ids": [...],
"salt": "..."}``; answer ``{"tiers": ["host", "disk", ...]}``, one tier per leading chunk
held. A client that cannot reach the server (not up yet, gone) answers "nothing held" and
says so once in the log: a miss costs recompute, never an error.

Thread-safety: the server answers each connection on its own thread (``KVManager.lookup``
is thread-safe); a client is one connection, used from one thread at a time (a lock).
"""

from __future__ import annotations

import json
import logging
import socket
import socketserver
import struct
import sys
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvtier.manager import KVManager

log = logging.getLogger(__name__)

_HEADER = struct.Struct(">I")
TIMEOUT_S = 5.0


def socket_address(engine_id: str) -> str:
    """Where the worker of vLLM engine ``engine_id`` serves lookups: an abstract socket
    name on Linux, a file in the temporary folder elsewhere."""
    name = "kvtier-vllm-" + "".join(c for c in engine_id if c.isalnum() or c in "-_")[:40]
    if sys.platform.startswith("linux"):
        return "\0" + name
    return str(Path(tempfile.gettempdir()) / f"{name}.sock")


def _unlink(address: str) -> None:
    if not address.startswith("\0"):
        Path(address).unlink(missing_ok=True)


def _send(sock: socket.socket, body: dict[str, Any]) -> None:
    data = json.dumps(body).encode()
    sock.sendall(_HEADER.pack(len(data)) + data)


def _receive(sock: socket.socket) -> dict[str, Any] | None:
    """One message, or None when the peer closed the connection."""
    header = _read_exact(sock, _HEADER.size)
    if header is None:
        return None
    body = _read_exact(sock, _HEADER.unpack(header)[0])
    return None if body is None else dict(json.loads(body))


def _read_exact(sock: socket.socket, nbytes: int) -> bytes | None:
    parts = bytearray()
    while len(parts) < nbytes:
        part = sock.recv(nbytes - len(parts))
        if not part:
            return None
        parts += part
    return bytes(parts)


class LookupServer:
    """Answers lookups against ``manager`` at ``address`` (a daemon thread; ``close``
    stops it and removes a socket file)."""

    def __init__(self, manager: KVManager, address: str) -> None:
        self.address = address
        _unlink(address)  # a file a killed worker left

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                while (ask := _receive(self.request)) is not None:
                    hit = manager.lookup(ask["ids"], ask.get("salt", ""))
                    _send(self.request, {"tiers": hit.tiers})

        self._server = socketserver.ThreadingUnixStreamServer(address, Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="kvtier-lookup", daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        _unlink(self.address)


class LookupClient:
    """Asks the ``LookupServer`` at ``address``; reconnects on the next ask after a failure."""

    def __init__(self, address: str) -> None:
        self.address = address
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        self._warned = False

    def held_tiers(self, token_ids: Sequence[int], salt: str) -> list[str]:
        """The tier of each leading chunk of ``token_ids`` that the worker holds under
        ``salt`` (empty when the worker cannot be asked)."""
        with self._lock:
            try:
                if self._sock is None:
                    self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                    self._sock.settimeout(TIMEOUT_S)
                    self._sock.connect(self.address)
                _send(self._sock, {"ids": [int(t) for t in token_ids], "salt": salt})
                answer = _receive(self._sock)
                if answer is None:
                    raise ConnectionError("the worker closed the connection")
                return [str(t) for t in answer["tiers"]]
            except (OSError, ValueError, KeyError) as exc:
                self._drop()
                if not self._warned:
                    self._warned = True
                    log.warning(
                        "kvtier connector: cannot ask the worker at %s (%s); prompts miss "
                        "until it answers",
                        self.address.lstrip("\0"),
                        exc,
                    )
                return []

    def _drop(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def close(self) -> None:
        with self._lock:
            self._drop()
