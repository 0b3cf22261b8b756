"""Benchmark ``serve``: a production trace replayed against ``kvtier serve``, by tier set.

Question: serving real chat traffic, how many more prompt tokens does kvtier reuse, and how
much sooner does the first token come, when the KV that leaves the device can go to a large
host tier, or to a small host tier and a disk, instead of only a device-sized prefix cache?

Trace: the Mooncake "conversation" trace (``../shared/traces/conversation_trace.jsonl``, read
at run time, ``--trace``). Each 512-token block id becomes a fixed block of ``--block-tokens``
(64) token ids drawn from a generator seeded with the id, so equal leading ids are equal
leading tokens; prompts are cut to ``--max-prompt-tokens`` (1024; the embedded model's context
is 8K) and outputs to ``--max-output-tokens`` (16). Conversations are the requests that share
more than block 0 (the system prompt every request starts with). A window of consecutive
trace requests shares almost nothing but block 0 (the next turn of a conversation comes
minutes later), so the window is the first ``--requests`` (40) requests of a seeded sample
of ``--user-fraction`` (3 %) of the conversations, in arrival order: fewer users, each with
all their turns. Arrival times are the trace's divided by ``--time-factor`` (3): the window's
arrivals then span about as long as ``device_only`` needs to serve it here (load near 1).
The JSON records how much prefix the window shares, and how little a consecutive window
would.

Method: for each configuration the benchmark starts a ``kvtier serve`` process (embedded
model, one torch thread, ``--max-batch-size 4``: continuous batching, ``--chunk-tokens``
equal to the block size, so one trace block is one chunk), sends one unmeasured warm-up
request, then replays the window: each request is a streaming ``POST /v1/completions`` of
the token ids (greedy, ``ignore_eos``) sent at its arrival time on its own thread. TTFT is
send → first streamed token, inter-token latency the gaps between streamed chunks. Reused
tokens by tier come from ``/metrics`` (after minus before the replay). The server is then
stopped with SIGTERM. Each sequence's device budget (``--device-budget-mb``, 64 MiB) holds
a capped request's whole KV (1040 tokens × 45 KiB for the embedded model), so no request
streams from the host and the configurations differ only in what they can reuse. They run
one after another on the same window (``--repeats`` alternates them A B C A B C):

- ``device_only``: kvtier always keeps sealed chunks in its host tier, so a device-only
  prefix cache is expressed as a host tier of the device's size (``--device-budget-mb`` ×
  ``--max-batch-size``) and no disk: only what a device-sized cache holds is reusable.
- ``device_host``: a host tier ``--host-factor`` (8) × that size.
- ``device_host_disk``: the device-sized host tier plus a ``--disk-mb`` disk tier in a
  temporary folder, which receives the chunks the host evicts (write-back).

Summary: reused tokens and p50 TTFT of each configuration ÷ ``device_only``'s.
"""

from __future__ import annotations

import argparse
import hashlib
import http.client
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvtier.bench.common import base_parser, machine_info, median, print_machine, write_json

DEFAULT_TRACE = (
    Path(__file__).resolve().parents[3].parent / "shared/traces/conversation_trace.jsonl"
)
TRACE_BLOCK_TOKENS = 512  # tokens per hash id in the trace
# Ids drawn for the blocks: below 30000, so any llama-family vocabulary (>= 32000) holds them,
# and above the special and byte tokens.
TOKEN_ID_RANGE = (1000, 30000)
CONFIGS = ("device_only", "device_host", "device_host_disk")
MODEL_NAME = "kvtier-bench"


# ---- the trace -------------------------------------------------------------------------------


@dataclass(frozen=True)
class TraceRecord:
    """One request of the trace (lengths in the trace's tokens, 512 to a hash id)."""

    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def load_trace(path: Path) -> list[TraceRecord]:
    """Every request of a Mooncake-format JSONL trace, in file (arrival) order.

    Raises:
        FileNotFoundError: no file at ``path`` (one line naming it and ``--trace``).
        ValueError: a line that is not a trace record.
    """
    if not path.is_file():
        raise FileNotFoundError(f"trace: {path} not found; pass --trace PATH to the JSONL trace")
    records: list[TraceRecord] = []
    with path.open() as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                records.append(
                    TraceRecord(
                        int(row["timestamp"]),
                        int(row["input_length"]),
                        int(row["output_length"]),
                        tuple(int(h) for h in row["hash_ids"]),
                    )
                )
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"trace: {path}:{number} is not a trace record ({exc})") from None
    return records


def conversation_ids(trace: list[TraceRecord]) -> list[int]:
    """For each request, the index of the first request of its conversation.

    Two requests are one conversation when they share more than block 0 (the system prompt
    all requests share): a request joins the conversation that first used its second block.
    """
    owner: dict[int, int] = {}
    ids: list[int] = []
    for index, record in enumerate(trace):
        blocks = record.hash_ids
        conversation = owner.get(blocks[1], index) if len(blocks) > 1 else index
        ids.append(conversation)
        for block in blocks[1:]:
            owner.setdefault(block, conversation)
    return ids


def keeps_conversation(conversation: int, fraction: float, seed: int) -> bool:
    """Whether the seeded sample of ``fraction`` of the conversations holds this one."""
    digest = hashlib.sha256(f"{seed}:{conversation}".encode()).digest()
    return int.from_bytes(digest[:8], "big") < fraction * 2**64


def sample_window(trace: list[TraceRecord], requests: int, fraction: float, seed: int) -> list[int]:
    """Indices of the first ``requests`` requests of the sampled conversations (all of them
    with ``fraction`` 1: a window of consecutive requests), in arrival order.

    Raises:
        ValueError: ``requests`` < 1, ``fraction`` outside (0, 1], or too few requests.
    """
    if requests < 1:
        raise ValueError(f"--requests: must be >= 1, got {requests}")
    if not 0 < fraction <= 1:
        raise ValueError(f"--user-fraction: must be in (0, 1], got {fraction}")
    conversations = conversation_ids(trace)
    kept = [i for i, c in enumerate(conversations) if keeps_conversation(c, fraction, seed)]
    chosen = kept[:requests]
    if len(chosen) < requests:
        raise ValueError(
            f"--requests: the sample holds only {len(chosen)} requests; raise --user-fraction "
            "or lower --requests"
        )
    return chosen


@dataclass(frozen=True)
class Scaling:
    """How trace requests become requests for a small model.

    Attributes:
        block_tokens: token ids per trace block (the trace's are 512 tokens).
        max_prompt_tokens: prompts are cut to this many tokens.
        max_output_tokens: outputs are cut to this many tokens.
        time_factor: trace seconds per replay second (arrivals come this much faster).
    """

    block_tokens: int
    max_prompt_tokens: int
    max_output_tokens: int
    time_factor: float

    def __post_init__(self) -> None:
        for name in ("block_tokens", "max_prompt_tokens", "max_output_tokens"):
            if getattr(self, name) < 1:
                flag = name.replace("_", "-")
                raise ValueError(f"--{flag}: must be >= 1, got {getattr(self, name)}")
        if not self.time_factor > 0:
            raise ValueError(f"--time-factor: must be > 0, got {self.time_factor}")


@dataclass(frozen=True)
class ReplayRequest:
    """One request of the replay.

    Attributes:
        index: its line in the trace (0-based).
        conversation: the index of its conversation's first request.
        arrival_s: when to send it, seconds after the window's first request.
        prompt_ids: the prompt's token ids.
        max_tokens: tokens to generate.
    """

    index: int
    conversation: int
    arrival_s: float
    prompt_ids: tuple[int, ...]
    max_tokens: int


def block_ids(hash_id: int, block_tokens: int) -> np.ndarray:
    """The fixed token ids of one trace block: a generator seeded with the id."""
    low, high = TOKEN_ID_RANGE
    return np.random.default_rng(hash_id).integers(low, high, size=block_tokens)


def prompt_ids(record: TraceRecord, scaling: Scaling) -> tuple[int, ...]:
    """A trace request's prompt: its blocks' ids, ``input_length`` scaled and capped."""
    size = scaling.block_tokens
    tokens = math.ceil(record.input_length * size / TRACE_BLOCK_TOKENS)
    tokens = max(1, min(tokens, scaling.max_prompt_tokens, len(record.hash_ids) * size))
    blocks = [block_ids(h, size) for h in record.hash_ids[: math.ceil(tokens / size)]]
    return tuple(int(t) for t in np.concatenate(blocks)[:tokens])


def build_window(
    trace: list[TraceRecord], indices: list[int], scaling: Scaling
) -> list[ReplayRequest]:
    """The replay of ``trace[indices]``: scaled prompts and outputs, compressed arrivals."""
    conversations = conversation_ids(trace)
    start_ms = trace[indices[0]].timestamp_ms
    return [
        ReplayRequest(
            index=i,
            conversation=conversations[i],
            arrival_s=(trace[i].timestamp_ms - start_ms) / 1000 / scaling.time_factor,
            prompt_ids=prompt_ids(trace[i], scaling),
            max_tokens=max(1, min(trace[i].output_length, scaling.max_output_tokens)),
        )
        for i in indices
    ]


def window_sharing(window: list[ReplayRequest], chunk_tokens: int) -> dict[str, Any]:
    """How much prefix the window shares: prompt tokens an unbounded cache of every earlier
    prompt's whole chunks would serve (the most any configuration can reuse), and how many
    of those are the first chunk alone (the system prompt).
    """
    seen: set[bytes] = set()
    shared_chunks = beyond_first_chunks = 0
    for request in window:
        ids = request.prompt_ids
        keys: list[bytes] = []
        parent = b""
        for start in range(0, len(ids) - len(ids) % chunk_tokens, chunk_tokens):
            chunk = np.asarray(ids[start : start + chunk_tokens], dtype=np.int64).tobytes()
            parent = hashlib.sha256(parent + chunk).digest()
            keys.append(parent)
        usable = (len(ids) - 1) // chunk_tokens  # reuse leaves the last token to compute
        hits = 0
        while hits < usable and keys[hits] in seen:
            hits += 1
        shared_chunks += hits
        beyond_first_chunks += max(0, hits - 1)
        seen.update(keys)
    prompt_tokens = sum(len(r.prompt_ids) for r in window)
    return {
        "requests": len(window),
        "conversations": len({r.conversation for r in window}),
        "prompt_tokens": prompt_tokens,
        "shareable_tokens": shared_chunks * chunk_tokens,
        "shareable_fraction": shared_chunks * chunk_tokens / prompt_tokens,
        "shareable_tokens_beyond_first_chunk": beyond_first_chunks * chunk_tokens,
        "arrival_span_s": window[-1].arrival_s - window[0].arrival_s,
    }


# ---- the client ------------------------------------------------------------------------------


@dataclass
class Reply:
    """What the client saw of one streamed request.

    Attributes:
        index: the request's line in the trace.
        sent_s: when it was sent, seconds after the replay started.
        ttft_s: send → first streamed token (None: no token came).
        gaps_s: seconds between consecutive streamed chunks (one token each, except that the
            server sends no chunk for a token whose text is still empty).
        text: the streamed text.
        prompt_tokens: the prompt's length.
        completion_tokens: tokens generated (the usage chunk's count).
        cached_tokens: prompt tokens the server reused (the usage chunk's count).
        done_s: when the stream ended, seconds after the replay started.
        error: why it failed (None: it did not).
    """

    index: int
    sent_s: float
    prompt_tokens: int
    ttft_s: float | None = None
    gaps_s: list[float] = field(default_factory=list)
    text: str = ""
    completion_tokens: int = 0
    cached_tokens: int = 0
    done_s: float = 0.0
    error: str | None = None


def stream_completion(port: int, request: ReplayRequest, start: float, timeout_s: float) -> Reply:
    """Send one streaming completion of token ids; time every chunk. Never raises: a
    failure (refused, HTTP error, error event) is recorded in ``Reply.error``."""
    body = {
        "model": MODEL_NAME,
        "prompt": list(request.prompt_ids),
        "max_tokens": request.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    sent = time.perf_counter()
    reply = Reply(request.index, sent - start, len(request.prompt_ids))
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    try:
        conn.request(
            "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
        )
        response = conn.getresponse()
        if response.status != 200:
            reply.error = f"HTTP {response.status}: {response.read()[:200]!r}"
            return reply
        last = sent
        parts: list[str] = []
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            payload = line[5:].strip()
            if payload == "[DONE]":
                break
            event = json.loads(payload)
            if "error" in event:
                reply.error = str(event["error"].get("message"))
                break
            now = time.perf_counter()
            if event.get("choices"):
                if reply.ttft_s is None:
                    reply.ttft_s = now - sent
                else:
                    reply.gaps_s.append(now - last)
                last = now
                parts.append(event["choices"][0].get("text", ""))
            if event.get("usage"):
                usage = event["usage"]
                reply.completion_tokens = int(usage["completion_tokens"])
                details = usage.get("prompt_tokens_details") or {}
                reply.cached_tokens = int(details.get("cached_tokens") or 0)
        reply.text = "".join(parts)
    except (OSError, http.client.HTTPException, ValueError) as exc:
        reply.error = f"{type(exc).__name__}: {exc}"
    finally:
        conn.close()
        reply.done_s = time.perf_counter() - start
    return reply


def replay(port: int, window: list[ReplayRequest], timeout_s: float) -> list[Reply]:
    """Send every request at its arrival time on its own thread; wait for all replies."""
    replies: list[Reply | None] = [None] * len(window)

    def send(slot: int, request: ReplayRequest) -> None:
        replies[slot] = stream_completion(port, request, start, timeout_s)

    threads: list[threading.Thread] = []
    start = time.perf_counter()
    for slot, request in enumerate(window):
        delay_s = start + request.arrival_s - time.perf_counter()
        if delay_s > 0:
            time.sleep(delay_s)
        thread = threading.Thread(target=send, args=(slot, request), daemon=True)
        thread.start()
        threads.append(thread)
    for thread in threads:
        thread.join()
    return [r for r in replies if r is not None]


# ---- the server ------------------------------------------------------------------------------


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

    def flags(self, disk_dir: Path | None) -> list[str]:
        """The ``kvtier serve`` flags of this configuration (``disk_dir`` when it has disk)."""
        flags = [
            *("--device-budget-mb", str(self.device_budget_mb)),
            *("--max-batch-size", str(self.max_batch_size)),
            *("--host-mb", str(self.host_mb)),
            *("--chunk-tokens", str(self.chunk_tokens)),
            *("--max-queued", str(self.max_queued)),
        ]
        if self.disk_mb is not None:
            if disk_dir is None:
                raise ValueError(f"{self.name}: a disk tier needs a folder")
            flags += ["--disk-dir", str(disk_dir), "--disk-mb", str(self.disk_mb)]
        return flags


def server_configs(
    device_budget_mb: int,
    max_batch_size: int,
    host_factor: float,
    disk_mb: int,
    chunk_tokens: int,
    max_queued: int,
) -> dict[str, ServerConfig]:
    """The three configurations; the device-only host tier is the whole device budget."""
    device_mb = device_budget_mb * max_batch_size
    if host_factor < 1:
        raise ValueError(f"--host-factor: must be >= 1, got {host_factor}")
    if disk_mb < 1:
        raise ValueError(f"--disk-mb: must be >= 1, got {disk_mb}")
    common = dict(
        device_budget_mb=device_budget_mb,
        max_batch_size=max_batch_size,
        chunk_tokens=chunk_tokens,
        max_queued=max_queued,
    )
    return {
        "device_only": ServerConfig("device_only", host_mb=device_mb, **common),
        "device_host": ServerConfig(
            "device_host", host_mb=round(device_mb * host_factor), **common
        ),
        "device_host_disk": ServerConfig(
            "device_host_disk", host_mb=device_mb, disk_mb=disk_mb, **common
        ),
    }


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


_SAMPLE = re.compile(r"^([A-Za-z_:][\w:]*)(?:\{(.*)\})?\s+(\S+)$")
_LABEL = re.compile(r'\w+="((?:[^"\\]|\\.)*)"')


def parse_metrics(text: str) -> dict[tuple[str, str], float]:
    """Prometheus text → ``{(name, label values joined by ","): value}``; a counter's
    ``_total`` suffix is dropped, so ``kvtier_reused_tokens_total{tier="host"} 5`` reads
    as ``("kvtier_reused_tokens", "host"): 5.0``."""
    samples: dict[tuple[str, str], float] = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line.strip())
        if match is None or line.startswith("#"):
            continue
        name, labels, value = match.groups()
        name = name.removesuffix("_total")
        samples[(name, ",".join(_LABEL.findall(labels or "")))] = float(value)
    return samples


def by_label(samples: dict[tuple[str, str], float], name: str) -> dict[str, float]:
    """Every sample of metric ``name``, by label value."""
    return {label: value for (n, label), value in samples.items() if n == name}


class Server:
    """A ``kvtier serve`` process of one configuration, on a free port, logging to a file.

    ``start`` blocks until ``/health`` answers (or raises with the log's tail); ``stop``
    sends SIGTERM and waits for the drain; the process is killed if it does not end.
    """

    def __init__(
        self, config: ServerConfig, workdir: Path, model: str | None, timeout_s: float
    ) -> None:
        self.config = config
        self.port = free_port()
        self.timeout_s = timeout_s
        self.disk_dir = workdir / f"disk-{config.name}" if config.disk_mb is not None else None
        self.log_path = workdir / f"serve-{config.name}.log"
        command = [sys.executable, "-m", "kvtier.cli", "serve", "--port", str(self.port)]
        command += ["--served-model-name", MODEL_NAME, "--log-level", "warning"]
        command += config.flags(self.disk_dir)
        if model is not None:
            command += ["--model", model]
        self.command = command
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        # The server has no thread flag: OMP_NUM_THREADS sets torch's intra-op threads.
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(self.command, env=env, stdout=log, stderr=log)
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                url = f"http://127.0.0.1:{self.port}/health"
                with urllib.request.urlopen(url, timeout=2) as reply:
                    if reply.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(
                    f"kvtier serve ({self.config.name}) did not start: {self.log_tail()}"
                )
            time.sleep(0.25)

    def metrics(self) -> dict[tuple[str, str], float]:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=30) as r:
            return parse_metrics(r.read().decode())

    def stop(self) -> int:
        """SIGTERM, then wait for the drain (and the host tier's flush to disk)."""
        if self.process is None:
            return 0
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=self.timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
        return int(self.process.returncode)

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def log_tail(self, lines: int = 5) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return " | ".join(text.strip().splitlines()[-lines:])


# ---- one configuration -----------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100), interpolated linearly between order statistics (as
    numpy's default); None when there are no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = q / 100 * (len(ordered) - 1)
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def reply_figures(replies: list[Reply]) -> dict[str, Any]:
    """Latency percentiles and output rate of one replay, from what the client saw.

    Output tokens/s is every generated token ÷ (last reply's end − first send).
    """
    ok = [r for r in replies if r.error is None and r.ttft_s is not None]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    gaps = [g for r in ok for g in r.gaps_s]
    output_tokens = sum(r.completion_tokens for r in ok)
    wall_s = max(r.done_s for r in replies) - min(r.sent_s for r in replies) if replies else 0.0
    return {
        "requests": len(replies),
        "ok": len(ok),
        "errors": [f"#{r.index}: {r.error}" for r in replies if r.error is not None][:5],
        "ttft_s": {f"p{q}": percentile(ttfts, q) for q in (50, 90, 99)},
        "itl_s": {f"p{q}": percentile(gaps, q) for q in (50, 90, 99)},
        "output_tokens": output_tokens,
        "wall_s": wall_s,
        "output_tokens_per_s": output_tokens / wall_s if wall_s > 0 else None,
        "cached_tokens_in_usage": sum(r.cached_tokens for r in ok),
    }


def metric_figures(
    before: dict[tuple[str, str], float], after: dict[tuple[str, str], float]
) -> dict[str, Any]:
    """What the server's counters say happened between two scrapes (after − before): prompt
    and reused tokens (by the tier that held each reused chunk), and each tier's traffic."""

    def delta(name: str) -> dict[str, float]:
        old = by_label(before, name)
        return {k: v - old.get(k, 0.0) for k, v in sorted(by_label(after, name).items())}

    reused = {tier: int(v) for tier, v in delta("kvtier_reused_tokens").items() if v}
    prompt_tokens = int(delta("kvtier_prompt_tokens").get("", 0))
    tiers: dict[str, dict[str, float]] = {}
    for counter in ("hits", "bytes_in", "bytes_out", "evictions"):
        for tier, value in delta(f"kvtier_tier_{counter}").items():
            tiers.setdefault(tier, {})[counter] = value
    for tier, value in by_label(after, "kvtier_tier_used_bytes").items():
        tiers.setdefault(tier, {})["used_bytes_after"] = value
    return {
        "prompt_tokens": prompt_tokens,
        "reused_tokens": sum(reused.values()),
        "reused_tokens_by_tier": reused,
        "reused_fraction": sum(reused.values()) / prompt_tokens if prompt_tokens else 0.0,
        "tiers": tiers,
    }


def run_config(
    config: ServerConfig,
    window: list[ReplayRequest],
    workdir: Path,
    model: str | None,
    timeout_s: float,
) -> tuple[dict[str, Any], list[Reply]]:
    """Start the server, warm it up, replay the window, stop it; its figures and replies."""
    server = Server(config, workdir, model, timeout_s)
    load_before = os.getloadavg()[0]  # the machine is shared: record how busy it was
    server.start()
    try:
        # Warm-up: shorter than a chunk, so it seals nothing that the window could reuse.
        warm_ids = np.random.default_rng(1 << 40).integers(
            *TOKEN_ID_RANGE, config.chunk_tokens // 2
        )
        warm = ReplayRequest(-1, -1, 0.0, tuple(int(t) for t in warm_ids), 4)
        warm_reply = stream_completion(server.port, warm, time.perf_counter(), timeout_s)
        if warm_reply.error is not None:
            raise RuntimeError(f"{config.name}: the warm-up request failed: {warm_reply.error}")
        before = server.metrics()
        replies = replay(server.port, window, timeout_s)
        after = server.metrics()
    finally:
        exit_code = server.stop()
        if server.disk_dir is not None:
            shutil.rmtree(server.disk_dir, ignore_errors=True)
    figures = {
        "config": asdict(config),
        "flags": config.flags(server.disk_dir),
        **reply_figures(replies),
        **metric_figures(before, after),
        "server_exit_code": exit_code,
        "load_avg_1m": [load_before, os.getloadavg()[0]],
    }
    if exit_code != 0:
        figures["server_log_tail"] = server.log_tail()
    return figures, replies


# ---- summary ---------------------------------------------------------------------------------


def headline(runs: list[dict[str, Any]]) -> dict[str, float | None]:
    """A configuration's headline figures: the median over its runs (repeats)."""

    def med(values: list[float | None]) -> float | None:
        present = [v for v in values if v is not None]
        return median(present) if present else None

    return {
        "reused_tokens": med([r["reused_tokens"] for r in runs]),
        "reused_fraction": med([r["reused_fraction"] for r in runs]),
        "ttft_p50_s": med([r["ttft_s"]["p50"] for r in runs]),
        "ttft_p90_s": med([r["ttft_s"]["p90"] for r in runs]),
        "ttft_p99_s": med([r["ttft_s"]["p99"] for r in runs]),
        "itl_p50_s": med([r["itl_s"]["p50"] for r in runs]),
        "itl_p99_s": med([r["itl_s"]["p99"] for r in runs]),
        "output_tokens_per_s": med([r["output_tokens_per_s"] for r in runs]),
    }


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """``numerator / denominator``; None when either is missing or the denominator is 0."""
    if numerator is None or denominator is None or denominator == 0:
        return None
    return numerator / denominator


def summarize(headlines: dict[str, dict[str, float | None]]) -> dict[str, Any]:
    """The summary: each configuration's reused tokens and p50 TTFT ÷ ``device_only``'s
    (``device_host_disk``'s under the plain names, ``device_host``'s prefixed), and every
    configuration's headline figures under ``NAME_FIGURE``."""
    base = headlines.get("device_only", {})
    summary: dict[str, Any] = {}
    for name, prefix in (("device_host_disk", ""), ("device_host", "device_host_")):
        case = headlines.get(name, {})
        summary[f"{prefix}reused_tokens_ratio_vs_device_only"] = ratio(
            case.get("reused_tokens"), base.get("reused_tokens")
        )
        summary[f"{prefix}ttft_p50_ratio_vs_device_only"] = ratio(
            case.get("ttft_p50_s"), base.get("ttft_p50_s")
        )
    for name, figures in headlines.items():
        for figure, value in figures.items():
            summary[f"{name}_{figure}"] = value
    return summary


def same_texts(texts: dict[str, list[dict[int, str | None]]]) -> tuple[int, int]:
    """(requests whose text is the same in every run of every configuration, requests);
    a failed request (None) is never the same."""
    runs = [run for config_runs in texts.values() for run in config_runs]
    if not runs:
        return 0, 0
    indices = sorted(set().union(*(run.keys() for run in runs)))
    same = 0
    for index in indices:
        seen = {run.get(index) for run in runs}
        same += len(seen) == 1 and None not in seen
    return same, len(indices)


# ---- main ------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = base_parser("serve", __doc__.splitlines()[0] if __doc__ else "serve")
    add = parser.add_argument
    add("--trace", type=Path, default=DEFAULT_TRACE, help="the JSONL trace (Mooncake format)")
    add("--requests", type=int, default=None, help="requests in the window (40; quick 8)")
    add("--user-fraction", type=float, default=0.03, help="conversations sampled (1: consecutive)")
    add("--block-tokens", type=int, default=64, help="token ids per trace block (of 512)")
    add("--max-prompt-tokens", type=int, default=None, help="prompt cap (1024; quick 512)")
    add("--max-output-tokens", type=int, default=None, help="output cap (16; quick 8)")
    add("--time-factor", type=float, default=None, help="trace s per replay s (3; quick 15)")
    add("--device-budget-mb", type=int, default=64, help="device KV budget per sequence")
    add("--max-batch-size", type=int, default=4, help="sequences run together")
    add("--host-factor", type=float, default=8.0, help="device_host's host tier ÷ device budget")
    add("--disk-mb", type=int, default=4096, help="device_host_disk's disk tier")
    add("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS, help="which to run")
    add("--repeats", type=int, default=1, help="replays of each configuration (A B C A B C …)")
    add("--model", default=None, help="HF folder or .gguf for the server (default: embedded)")
    add("--dir", type=Path, default=None, help="where the disk tier and server logs go")
    add("--timeout-s", type=float, default=600.0, help="per request and per server start/stop")
    args = parser.parse_args(argv)
    quick = args.quick
    defaults = {"requests": 40, "max_prompt_tokens": 1024, "max_output_tokens": 16}
    quick_defaults = {"requests": 8, "max_prompt_tokens": 512, "max_output_tokens": 8}
    for name, value in (quick_defaults if quick else defaults).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.time_factor is None:
        args.time_factor = 15.0 if quick else 3.0
    for flag in ("repeats", "device_budget_mb", "max_batch_size"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')}: must be >= 1, got {getattr(args, flag)}")
    return args


def print_table(runs: dict[str, list[dict[str, Any]]]) -> None:
    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value * 1e3:.0f}"

    print(
        f"{'config':<18}{'host MB':>8}{'disk MB':>8}{'reused':>8}{'%':>5}{'host':>7}{'disk':>7}"
        f"{'TTFT p50':>9}{'p90':>7}{'p99':>7}{'ITL p50':>8}{'p99':>6}{'tok/s':>7}{'ok':>5}"
    )
    print(f"{'':<47}{'(ms)':>9}")
    for name, config_runs in runs.items():
        for case in config_runs:
            config, by_tier = case["config"], case["reused_tokens_by_tier"]
            disk_mb = config["disk_mb"] or 0
            rate = case["output_tokens_per_s"] or 0.0
            print(
                f"{name:<18}{config['host_mb']:>8}{disk_mb:>8}{case['reused_tokens']:>8}"
                f"{case['reused_fraction'] * 100:>5.0f}{by_tier.get('host', 0):>7}"
                f"{by_tier.get('disk', 0):>7}{ms(case['ttft_s']['p50']):>9}"
                f"{ms(case['ttft_s']['p90']):>7}{ms(case['ttft_s']['p99']):>7}"
                f"{ms(case['itl_s']['p50']):>8}{ms(case['itl_s']['p99']):>6}{rate:>7.1f}"
                f"{case['ok']:>3}/{case['requests']}"
            )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    scaling = Scaling(
        args.block_tokens, args.max_prompt_tokens, args.max_output_tokens, args.time_factor
    )
    configs = server_configs(
        args.device_budget_mb,
        args.max_batch_size,
        args.host_factor,
        args.disk_mb,
        args.block_tokens,  # one trace block = one chunk
        max(64, 2 * args.requests),  # never 429: every request waits its turn
    )
    trace = load_trace(args.trace)
    window = build_window(
        trace, sample_window(trace, args.requests, args.user_fraction, args.seed), scaling
    )
    consecutive = build_window(trace, list(range(args.requests)), scaling)
    sharing = window_sharing(window, args.block_tokens)
    torch.set_num_threads(1)  # as the server's (OMP_NUM_THREADS=1), so the header says so
    info = machine_info({"host<->disk": "real (local disk, O_DIRECT where it is supported)"})
    print_machine(info)
    print(
        f"trace: {args.trace.name}, {sharing['requests']} requests of {sharing['conversations']} "
        f"conversations ({args.user_fraction:.0%} of them sampled, seed {args.seed}), "
        f"{args.block_tokens} tokens a block, prompts <= {args.max_prompt_tokens}, outputs <= "
        f"{args.max_output_tokens}, time / {args.time_factor:g} "
        f"(arrivals over {sharing['arrival_span_s']:.0f} s)"
    )
    print(
        f"window: {sharing['prompt_tokens']} prompt tokens, at most {sharing['shareable_tokens']} "
        f"({sharing['shareable_fraction']:.0%}) reusable, "
        f"{sharing['shareable_tokens_beyond_first_chunk']} beyond the system prompt"
    )
    workdir = Path(tempfile.mkdtemp(prefix="kvtier-bench-serve-", dir=args.dir))
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in args.configs}
    texts: dict[str, list[dict[int, str | None]]] = {name: [] for name in args.configs}
    try:
        for _ in range(args.repeats):
            for name in args.configs:
                case, replies = run_config(
                    configs[name], window, workdir, args.model, args.timeout_s
                )
                runs[name].append(case)
                texts[name].append({r.index: r.text if r.error is None else None for r in replies})
                case["replies"] = [
                    {**asdict(r), "gaps_s": [round(g, 4) for g in r.gaps_s]} for r in replies
                ]
                p50 = case["ttft_s"]["p50"]
                print(
                    f"  {name}: reused {case['reused_tokens']} of {case['prompt_tokens']} prompt "
                    f"tokens {case['reused_tokens_by_tier']}, TTFT p50 "
                    f"{'-' if p50 is None else f'{p50:.2f} s'}, {case['ok']}/{case['requests']} "
                    f"ok, {case['wall_s']:.0f} s",
                    flush=True,
                )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    headlines = {name: headline(config_runs) for name, config_runs in runs.items()}
    summary = summarize(headlines)
    same, total = same_texts(texts)
    summary["same_text_requests"] = same
    summary["requests"] = total
    summary["all_ok"] = all(c["ok"] == c["requests"] for rs in runs.values() for c in rs)
    print_table(runs)
    result = {
        "summary": summary,
        "cases": runs,
        "config": {
            "quick": args.quick,
            "seed": args.seed,
            "trace": str(args.trace),
            "window": {
                "selection": "first requests of a seeded sample of the conversations",
                "user_fraction": args.user_fraction,
                "requests": args.requests,
                "trace_indices": [r.index for r in window],
            },
            "scaling": asdict(scaling),
            "window_sharing": sharing,
            "consecutive_window_sharing": window_sharing(consecutive, args.block_tokens),
            "servers": {name: asdict(configs[name]) for name in args.configs},
            "device_only_meaning": (
                "host tier = the device budget of all running sequences, no disk: kvtier "
                "keeps sealed chunks in its host tier, so this is a device-sized prefix cache"
            ),
            "repeats": args.repeats,
            "model": args.model or "embedded",
            "server_torch_threads": 1,
            "request": "POST /v1/completions, token ids, stream, temperature 0, ignore_eos",
        },
        "machine": info,
    }
    write_json(args.json, result)
    fmt = "{:.2f}".format

    def show(value: float | None) -> str:
        return "-" if value is None else fmt(value)

    print(
        f"summary: reused tokens vs device-only: device+host "
        f"{show(summary['device_host_reused_tokens_ratio_vs_device_only'])}x, device+host+disk "
        f"{show(summary['reused_tokens_ratio_vs_device_only'])}x; TTFT p50 vs device-only: "
        f"device+host {show(summary['device_host_ttft_p50_ratio_vs_device_only'])}x, "
        f"device+host+disk {show(summary['ttft_p50_ratio_vs_device_only'])}x; same text "
        f"{same}/{total}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
