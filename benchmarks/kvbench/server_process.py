"""A server process on a loopback port, as the benchmarks run ``kvtier serve`` and
``vllm serve``: started, waited for, stopped.

Contract: every benchmark runs ``kvtier serve`` through ``kvtier_serve_command`` (its argv
and environment): as ``Server``, one ``ServerConfig`` (sizes by name), or as
``kvtier_server``, free-form flags and a thread count. ``HttpServer.start`` blocks until
``/health`` answers (printing a progress line while it waits) and raises ``RuntimeError``
with the log's tail when the process dies or the timeout passes; ``stop`` sends SIGTERM,
waits for the drain, then kills; ``kill`` sends SIGKILL at once. One owner: not
thread-safe.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from kvbench.serve_client import MODEL_NAME, scrape_metrics


def free_port() -> int:
    """A loopback port no one listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def log_tail(path: Path, lines: int = 5) -> str:
    """The last ``lines`` of a server's log on one line (for an error message)."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return " | ".join(text.strip().splitlines()[-lines:])


class HttpServer:
    """A server process on a loopback port, logging to a file.

    Args:
        name: how progress lines and errors name it.
        command: its argv.
        env: its environment.
        port: the port it listens on (``/health`` is asked there).
        log_path: where its stdout and stderr go.
        timeout_s: the default wait for ``start`` and for ``stop``'s drain.
    """

    def __init__(
        self,
        name: str,
        command: list[str],
        env: dict[str, str],
        port: int,
        log_path: Path,
        timeout_s: float = 60.0,
    ) -> None:
        self.name, self.command, self.env, self.port = name, command, env, port
        self.log_path, self.timeout_s = log_path, timeout_s
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float | None = None) -> float:
        """Start it and wait for ``/health``; the seconds that took."""
        limit = self.timeout_s if timeout_s is None else timeout_s
        print(f"{self.name}: starting on port {self.port} (log {self.log_path})", flush=True)
        started = time.perf_counter()
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(self.command, env=self.env, stdout=log, stderr=log)
        next_note = started + 30
        while True:
            try:
                url = f"http://127.0.0.1:{self.port}/health"
                with urllib.request.urlopen(url, timeout=2) as reply:
                    if reply.status == 200:
                        seconds = time.perf_counter() - started
                        print(f"{self.name}: healthy after {seconds:.0f} s", flush=True)
                        return seconds
            except (urllib.error.URLError, OSError):
                pass
            now = time.perf_counter()
            if self.process.poll() is not None or now - started > limit:
                self.kill()
                raise RuntimeError(f"{self.name} did not start: {self.log_tail()}")
            if now > next_note:
                print(f"{self.name}: waiting for /health ({now - started:.0f} s)", flush=True)
                next_note = now + 30
            time.sleep(0.25)

    def metrics(self) -> dict[tuple[str, str], float]:
        """Its ``/metrics`` once (``serve_client.scrape_metrics``)."""
        return scrape_metrics(self.port)

    def stop(self, timeout_s: float | None = None) -> int:
        """SIGTERM, then wait for the drain (killed past the timeout); its exit code (0 if
        it never started)."""
        if self.process is None:
            return 0
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=self.timeout_s if timeout_s is None else timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
        return int(self.process.returncode)

    def kill(self) -> None:
        """SIGKILL now (if it runs), and reap it."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def log_tail(self, lines: int = 5) -> str:
        return log_tail(self.log_path, lines)


# ---- kvtier serve ----------------------------------------------------------------------------


def kvtier_serve_command(
    port: int, flags: list[str], threads: int
) -> tuple[list[str], dict[str, str]]:
    """``kvtier serve`` on ``port`` (serving ``MODEL_NAME``, logging warnings) with ``flags``
    and ``threads`` torch threads: its argv and its environment."""
    command = [sys.executable, "-m", "kvtier.cli", "serve", "--port", str(port)]
    command += ["--served-model-name", MODEL_NAME, "--log-level", "warning"]
    command += ["--threads", str(threads), *flags]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    return command, env


@dataclass(frozen=True)
class ServerConfig:
    """One configuration of ``kvtier serve`` (sizes in MiB, as its flags take them)."""

    name: str
    device_budget_mb: int
    max_batch_size: int
    host_mb: int
    chunk_tokens: int
    max_queued: int
    disk_mb: int | None = None
    eviction_policy: str = "lru"

    def flags(self, disk_dir: Path | None) -> list[str]:
        """The ``kvtier serve`` flags of this configuration (``disk_dir`` when it has disk)."""
        flags = [
            *("--device-budget-mb", str(self.device_budget_mb)),
            *("--max-batch-size", str(self.max_batch_size)),
            *("--host-mb", str(self.host_mb)),
            *("--chunk-tokens", str(self.chunk_tokens)),
            *("--max-queued", str(self.max_queued)),
            *("--eviction-policy", self.eviction_policy),
        ]
        if self.disk_mb is not None:
            if disk_dir is None:
                raise ValueError(f"{self.name}: a disk tier needs a folder")
            flags += ["--disk-dir", str(disk_dir), "--disk-mb", str(self.disk_mb)]
        return flags


class Server(HttpServer):
    """A ``kvtier serve`` process of one configuration, on a free port, logging to a file
    (``start`` and ``stop`` as ``HttpServer``'s, both bounded by ``timeout_s``). Flags may
    be added to ``command`` before ``start``."""

    def __init__(
        self, config: ServerConfig, workdir: Path, model: str | None, timeout_s: float
    ) -> None:
        port = free_port()
        self.config = config
        self.disk_dir = workdir / f"disk-{config.name}" if config.disk_mb is not None else None
        flags = config.flags(self.disk_dir) + ([] if model is None else ["--model", model])
        command, env = kvtier_serve_command(port, flags, threads=1)
        log_path = workdir / f"serve-{config.name}.log"
        super().__init__(f"kvtier serve ({config.name})", command, env, port, log_path, timeout_s)


def kvtier_server(flags: list[str], threads: int, workdir: Path) -> HttpServer:
    """``kvtier serve`` (embedded model) with ``flags`` and ``threads`` torch threads."""
    port = free_port()
    command, env = kvtier_serve_command(port, flags, threads)
    log = workdir / f"kvtier-serve-t{threads}.log"
    return HttpServer("kvtier serve", command, env, port, log)
