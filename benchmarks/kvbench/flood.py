"""Benchmark ``flood``: a burst of long prompts against a real ``kvtier serve``.

Question: when far more long prompts arrive at once than the server can serve in time,
does admission by cost (``--max-queue-s``) keep it healthy: every answer a 200 or a 429
with ``Retry-After``, memory within the configured tiers, and throughput after the flood
back at its level before?

Method. One ``kvtier serve`` process (the embedded model by default). Steady load before:
``--steady`` short requests from ``--clients`` concurrent clients, output tokens per second
of wall time. Then the flood: ``--flood`` long prompts sent at once (no client retries);
each answer's status, ``Retry-After`` and latency are kept, and the server's resident
memory is sampled every 50 ms. Then, once every flood request has its answer, the same
steady load again. Memory is judged against the budgets the server was given: its
growth over the idle server's must stay within the host tier plus the device budgets
(plus 64 MiB and 10 % for step buffers and the allocator).
"""

from __future__ import annotations

import json
import random
import tempfile
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import psutil

from kvbench.common import base_parser, finish, header
from kvbench.serve_client import MODEL_NAME, completion_request
from kvbench.server_process import HttpServer, ServerConfig, kvtier_server

MiB = 1 << 20
WORDS = ["river", "stone", "lamp", "orbit", "cedar", "violet", "harbor", "copper", "meadow"]


@dataclass(frozen=True)
class Answer:
    """One request's outcome."""

    status: int
    retry_after: str | None
    seconds: float
    completion_tokens: int


@dataclass(frozen=True)
class Settings:
    """The server's budgets and the load."""

    host_mb: int = 1024
    device_budget_mb: int = 128
    max_batch_size: int = 4
    max_queue_s: float = 30.0
    chunk_tokens: int = 256
    steady: int = 8
    clients: int = 4
    steady_words: int = 40
    steady_tokens: int = 32
    flood: int = 48
    flood_words: int = 1500
    flood_tokens: int = 16
    threads: int = 1

    def flags(self, model: str | None) -> list[str]:
        sizes = ServerConfig(
            "flood",
            self.device_budget_mb,
            self.max_batch_size,
            self.host_mb,
            self.chunk_tokens,
            max_queued=max(64, self.flood),
        )
        flags = [*sizes.flags(None), "--max-queue-s", str(self.max_queue_s)]
        return flags + (["--model", model] if model is not None else [])

    @property
    def budget_bytes(self) -> int:
        return (self.host_mb + self.device_budget_mb * self.max_batch_size) * MiB


def prompt(words: int, seed: int) -> str:
    rng = random.Random(seed)
    return f"Note {seed}: " + " ".join(rng.choice(WORDS) for _ in range(words))


def post(port: int, text: str, max_tokens: int, timeout_s: float = 600) -> Answer:
    """One greedy completion over plain HTTP (a 429 is an answer, not an error)."""
    body = {"model": MODEL_NAME, "prompt": text, "max_tokens": max_tokens, "temperature": 0}
    request = completion_request(port, {**body, "ignore_eos": True})
    start = time.perf_counter()
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as reply:
            usage = json.loads(reply.read())["usage"]
            return Answer(
                reply.status, None, time.perf_counter() - start, usage["completion_tokens"]
            )
    except urllib.error.HTTPError as error:
        error.read()
        return Answer(error.code, error.headers.get("Retry-After"), time.perf_counter() - start, 0)


def steady(port: int, s: Settings, seed: int) -> dict[str, Any]:
    """``s.steady`` short requests from ``s.clients`` clients: output tokens per second."""
    start = time.perf_counter()
    with ThreadPoolExecutor(s.clients) as pool:
        answers = list(
            pool.map(
                lambda i: post(port, prompt(s.steady_words, seed + i), s.steady_tokens),
                range(s.steady),
            )
        )
    wall = time.perf_counter() - start
    tokens = sum(a.completion_tokens for a in answers)
    return {
        "statuses": sorted({a.status for a in answers}),
        "output_tokens": tokens,
        "wall_s": wall,
        "output_tps": tokens / wall,
    }


class MemorySampler:
    """Samples a process's resident bytes every 50 ms on a thread until ``stop``."""

    def __init__(self, pid: int) -> None:
        self.process = psutil.Process(pid)
        self.peak = self.process.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            try:
                self.peak = max(self.peak, self.process.memory_info().rss)
            except psutil.Error:
                return

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def run(model: str | None, s: Settings, workdir: Path, seed: int) -> dict[str, Any]:
    server: HttpServer = kvtier_server(s.flags(model), s.threads, workdir)
    start_s = server.start(timeout_s=300)
    try:
        assert server.process is not None
        port = server.port
        steady(port, s, seed)  # warm: first touches, the work model's first steps
        idle_rss = psutil.Process(server.process.pid).memory_info().rss
        before = steady(port, s, seed + 1000)
        sampler = MemorySampler(server.process.pid)
        flood_start = time.perf_counter()
        with ThreadPoolExecutor(s.flood) as pool:
            answers = list(
                pool.map(
                    lambda i: post(port, prompt(s.flood_words, seed + 5000 + i), s.flood_tokens),
                    range(s.flood),
                )
            )
        flood_s = time.perf_counter() - flood_start
        peak_rss = sampler.stop()
        after = steady(port, s, seed + 1000)
    finally:
        code = server.stop()
    ok = [a for a in answers if a.status == 200]
    refused = [a for a in answers if a.status == 429]
    growth = peak_rss - idle_rss
    allowed = s.budget_bytes * 1.1 + 64 * MiB
    return {
        "summary": {
            "only_200_or_429": len(ok) + len(refused) == len(answers),
            "every_429_has_retry_after": all(
                a.retry_after is not None and a.retry_after.isdigit() and int(a.retry_after) >= 1
                for a in refused
            ),
            "served": len(ok),
            "refused": len(refused),
            "memory_within_budgets": growth <= allowed,
            "rss_growth_mb": growth / MiB,
            "throughput_after_vs_before": after["output_tps"] / before["output_tps"],
            "server_exit_code": code,
        },
        "before": before,
        "after": after,
        "flood": {
            "seconds": flood_s,
            "statuses": {str(k): sum(a.status == k for a in answers) for k in {200, 429}},
            "served_latency_s": sorted(a.seconds for a in ok),
            "retry_after_s": sorted(int(a.retry_after) for a in refused if a.retry_after),
        },
        "memory": {
            "idle_rss_mb": idle_rss / MiB,
            "peak_rss_mb": peak_rss / MiB,
            "budget_mb": s.budget_bytes / MiB,
            "allowed_growth_mb": allowed / MiB,
        },
        "server_start_s": start_s,
        "settings": asdict(s),
        "model": model or "embedded",
    }


def main(argv: list[str] | None = None) -> int:
    parser = base_parser("flood", __doc__)
    parser.add_argument("--model", default=None, help="HF folder (default: the embedded model)")
    parser.add_argument("--flood", type=int, default=None, help="long prompts at once (48)")
    parser.add_argument("--max-queue-s", type=float, default=30.0, help="the server's bound")
    args = parser.parse(argv)
    s = Settings(max_queue_s=args.max_queue_s)
    if args.quick:
        s = Settings(max_queue_s=args.max_queue_s, steady=4, flood=16, flood_words=600)
    if args.flood is not None:
        s = Settings(**{**asdict(s), "flood": args.flood})
    info = header()
    with tempfile.TemporaryDirectory(prefix="kvtier-flood-") as tmp:
        result = run(args.model, s, Path(tmp), args.seed)
    summary = result["summary"]
    memory = result["memory"]
    finish(
        args.json,
        result,
        info,
        f"flood of {s.flood}: {summary['served']} served, {summary['refused']} refused (429, "
        f"Retry-After {result['flood']['retry_after_s'][:1] or '-'}…); memory +"
        f"{summary['rss_growth_mb']:.0f} MiB of {memory['allowed_growth_mb']:.0f} allowed; "
        f"throughput {result['before']['output_tps']:.1f} tok/s before, "
        f"{result['after']['output_tps']:.1f} after "
        f"({summary['throughput_after_vs_before']:.2f}x)",
    )
    ok = summary["only_200_or_429"] and summary["every_429_has_retry_after"]
    return 0 if ok and summary["memory_within_budgets"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
