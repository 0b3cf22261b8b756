"""``kvtier serve`` as a process, probed as an outside tester would: huge bodies and
prompts are refused at once while ``/health`` stays quick, a vanished client's request is
cancelled, SIGTERM with a wedged stream exits within the drain timeout, and API keys come
from a file and can be tenants of their own."""

from __future__ import annotations

import json
import re
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from openai import OpenAI

from tests.engine.tiny import embedded_tokenizer, save_folder
from tests.server.test_serve_command import free_port, start

pytestmark = pytest.mark.slow

MB = 1 << 20


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tokenizer = embedded_tokenizer()
    path = tmp_path_factory.mktemp("tiny")
    save_folder(path, tokenizer)
    return path


def rss_bytes(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    match = re.search(r"VmRSS:\s+(\d+) kB", status)
    assert match is not None
    return int(match.group(1)) * 1024


def get(port: int, path: str, key: str | None = None) -> tuple[int, bytes]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}")
    if key:
        request.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(request, timeout=10) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def post_raw(
    port: int, body: bytes, chunked: bool = False, path: str = "/v1/completions"
) -> tuple[int, float]:
    """POST ``body`` to ``path``; the status and seconds until it came back."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    head += "Transfer-Encoding: chunked\r\n" if chunked else f"Content-Length: {len(body)}\r\n"
    begin = time.perf_counter()
    status: list[int] = []

    def read() -> None:
        line = sock.makefile("rb").readline()
        status.append(int(line.split()[1]) if line else 0)

    reader = threading.Thread(target=read)
    reader.start()
    try:
        sock.sendall((head + "\r\n").encode())
        step = 1 * MB
        for i in range(0, len(body), step):
            if status:
                break
            piece = body[i : i + step]
            sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece)
        if chunked and not status:
            sock.sendall(b"0\r\n\r\n")
    except OSError:
        pass  # the server answered and closed while we were still sending: expected
    reader.join(30)
    elapsed = time.perf_counter() - begin
    sock.close()
    return status[0], elapsed


class HealthProbe:
    """Polls /health every 20 ms from a thread; the slowest answer seen."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.worst_s = 0.0
        self.failures = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            begin = time.perf_counter()
            status, _ = get(self.port, "/health")
            self.worst_s = max(self.worst_s, time.perf_counter() - begin)
            self.failures += status != 200

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


@pytest.fixture
def server(folder: Path, tmp_path: Path) -> Iterator[tuple[Any, int]]:
    port = free_port()
    process = start(
        folder, tmp_path / "kv", port, "--drain-timeout", "2", "--served-model-name", "tiny"
    )
    yield process, port
    if process.poll() is None:
        process.kill()
        process.communicate()


def test_huge_bodies_and_prompts_are_refused_at_once(server: tuple[Any, int]) -> None:
    process, port = server
    assert get(port, "/health")[0] == 200
    before = rss_bytes(process.pid)
    # Every body is built before the probe starts (building them holds this process's GIL).
    text = json.dumps({"model": "tiny", "prompt": "word " * (10 * MB), "max_tokens": 1}).encode()
    ids = b"[" + b"1," * (25 * MB) + b"1]"
    # Under the body cap (1 MiB for this 2K-token model) but past the prompt's character cap
    # (64 per context token).
    long_text = json.dumps({"model": "tiny", "prompt": "x" * (64 * 2048 + 1)}).encode()
    # Under the body cap, built to make validation slow: every list stops at its first bad
    # item, whichever union member it is tried as.
    slow = [
        ("/v1/completions", {"model": "tiny", "prompt": [1.5] * 250_000}),
        ("/v1/completions", {"model": "tiny", "prompt": ["a"] + [1] * 500_000}),
        ("/v1/completions", {"model": "tiny", "prompt": "x", "stop": [1] * 500_000}),
        ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "x"}] * 60_000}),
    ]
    slow_bodies = [(path, json.dumps(body, separators=(",", ":")).encode()) for path, body in slow]
    assert all(len(data) < MB for _, data in slow_bodies)
    probe = HealthProbe(port)
    try:
        answers = [
            post_raw(port, text),  # a 50 MB text prompt, with Content-Length
            post_raw(port, text, chunked=True),  # and without one
            post_raw(port, ids),  # a 50 MB body of ids
            post_raw(port, long_text),
        ]
        answers += [post_raw(port, data, path=path) for path, data in slow_bodies]
    finally:
        probe.stop()
    assert [status for status, _ in answers] == [413, 413, 413, 400, 400, 400, 400, 400]
    assert all(seconds < 1.0 for _, seconds in answers), answers
    # A loop blocked by reading or validating one of these bodies answers in seconds; the
    # bound leaves room for a loaded machine (100.8 ms was seen on one).
    assert probe.worst_s < 0.25 and probe.failures == 0, probe.worst_s
    assert rss_bytes(process.pid) - before < 200 * MB


def cancelled_and_generated(port: int) -> tuple[float, float]:
    text = get(port, "/metrics")[1].decode()
    cancelled = re.search(r'^kvtier_requests_total\{outcome="cancelled"\} (\S+)$', text, re.M)
    generated = re.search(r"^kvtier_generation_tokens_total (\S+)$", text, re.M)
    assert cancelled is not None and generated is not None
    return float(cancelled.group(1)), float(generated.group(1))


def test_a_vanished_clients_request_is_cancelled(server: tuple[Any, int]) -> None:
    _, port = server
    body = {
        "model": "tiny",
        "prompt": "Tell me everything.",
        "max_tokens": 2000,
        "ignore_eos": True,
    }
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(data), data)
    )
    time.sleep(0.5)
    sock.close()  # a non-streaming client gives up
    deadline = time.monotonic() + 10
    while (counts := cancelled_and_generated(port))[0] < 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    cancelled, generated = counts
    assert cancelled == 1
    assert generated < 2000
    time.sleep(0.5)
    assert cancelled_and_generated(port)[1] == generated  # nothing runs for nobody


def test_sigterm_with_a_wedged_stream_exits_within_the_drain_timeout(
    server: tuple[Any, int],
) -> None:
    process, port = server
    body = {
        "model": "tiny",
        "prompt": "Go on forever.",
        "max_tokens": 2000,
        "ignore_eos": True,
        "stream": True,
    }
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", port))  # a client that never reads
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(data), data)
    )
    time.sleep(0.5)
    begin = time.monotonic()
    process.terminate()
    _, err = process.communicate(timeout=30)
    took = time.monotonic() - begin
    sock.close()
    assert took < 2 + 3, (took, err)  # the 2 s drain timeout, plus closing the tiers
    assert process.returncode == 0, err


def test_keys_from_a_file_salt_tenants_and_guard_metrics(folder: Path, tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("# tenants\nsk-alpha\nsk-beta\n")
    port = free_port()
    process = start(
        folder,
        tmp_path / "kv",
        port,
        "--api-key-file",
        str(keys),
        "--salt-by-key",
        "--metrics-need-key",
        "--served-model-name",
        "tiny",
        env={"KVTIER_API_KEYS": "sk-gamma"},
    )
    try:
        cmdline = Path(f"/proc/{process.pid}/cmdline").read_bytes()
        assert b"sk-alpha" not in cmdline and b"sk-gamma" not in cmdline
        prompt = "A prompt long enough for a few chunks of KV to be cached for reuse. " * 4

        def cached(key: str) -> int:
            client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0)
            reply = client.completions.create(model="tiny", prompt=prompt, max_tokens=2)
            assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
            return int(reply.usage.prompt_tokens_details.cached_tokens or 0)

        assert cached("sk-alpha") == 0
        assert cached("sk-alpha") > 0  # the same tenant reuses its KV
        assert cached("sk-beta") == 0  # another key never sees it
        assert cached("sk-gamma") == 0  # a key from the environment works, alone too
        assert get(port, "/metrics")[0] == 401
        assert get(port, "/metrics", "sk-beta")[0] == 200
        assert get(port, "/health")[0] == 200
    finally:
        process.terminate()
        process.communicate(timeout=30)
