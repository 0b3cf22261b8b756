"""A live uvicorn server in a background thread, for tests that speak HTTP to the app."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from typing import Any

import uvicorn
from openai import OpenAI

KEY = "sk-test"


class ServerThread:
    """uvicorn serving ``app`` on a free port of 127.0.0.1 from a background thread."""

    def __init__(self, app: Any) -> None:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [sock]}, daemon=True
        )
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)

    def client(self, api_key: str = KEY, **kw: Any) -> OpenAI:
        return OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key=api_key, **kw)

    def request(
        self, method: str, path: str, body: bytes | dict[str, Any] | None = None, key: str = KEY
    ) -> tuple[int, Any]:
        """A raw HTTP request (bodies the openai client would never send); JSON back."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        data = json.dumps(body).encode() if isinstance(body, dict) else body
        headers = {"Content-Type": "application/json"}
        if key:
            headers["Authorization"] = f"Bearer {key}"
        conn.request(method, path, body=data, headers=headers)
        response = conn.getresponse()
        raw = response.read()
        conn.close()
        is_json = response.getheader("content-type", "").startswith("application/json")
        return response.status, json.loads(raw) if is_json else raw.decode()

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
