"""The client side of ``kvtier bench serve``: streaming completions sent at their arrival
times, and what the client saw and the server's counters said, as figures.

Contract: talks to one ``kvtier serve`` on ``127.0.0.1:PORT`` over HTTP and never starts or
stops it. ``stream_completion`` and ``replay`` never raise for a failed request: the failure
is recorded in ``Reply.error``; ``stream_one`` (one request now, for the benchmarks that
send their own) raises ``RuntimeError`` instead. ``completion_request`` builds a plain
``POST /v1/completions``. ``scrape_metrics`` reads ``/metrics`` once; ``parse_metrics``,
``metric_figures``, ``reply_figures`` and ``percentile`` are pure functions.
"""

from __future__ import annotations

import http.client
import json
import math
import re
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Any

from kvbench.trace import ReplayRequest

MODEL_NAME = "kvtier-bench"  # the name the server serves and every request asks for


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


def completion_request(port: int, body: dict[str, Any]) -> urllib.request.Request:
    """``POST /v1/completions`` of ``body`` (as JSON) to the server on ``port``."""
    return urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )


def stream_completion(
    port: int, request: ReplayRequest, start: float, timeout_s: float, api_key: str | None = None
) -> Reply:
    """Send one streaming completion of token ids (as ``api_key`` where given); time every
    chunk. Never raises: a failure (refused, HTTP error, error event) is recorded in
    ``Reply.error``."""
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
    headers = {"Content-Type": "application/json"}
    if api_key is not None:
        headers["Authorization"] = f"Bearer {api_key}"
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), headers)
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


def stream_one(
    port: int, prompt: list[int], max_tokens: int, timeout_s: float, api_key: str | None = None
) -> Reply:
    """One streamed greedy completion of ``prompt``, sent now.

    Raises:
        RuntimeError: it failed, or no token came.
    """
    request = ReplayRequest(-1, -1, 0.0, tuple(prompt), max_tokens)
    reply = stream_completion(port, request, time.perf_counter(), timeout_s, api_key)
    if reply.error is not None or reply.ttft_s is None:
        raise RuntimeError(f"port {port}: a completion failed: {reply.error or 'no token'}")
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


# ---- the counters and the figures ------------------------------------------------------------


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


def scrape_metrics(port: int) -> dict[tuple[str, str], float]:
    """One read of the server's ``/metrics``, parsed (see ``parse_metrics``).

    Raises:
        OSError: the server did not answer (``urllib.error.URLError`` is one).
    """
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        return parse_metrics(r.read().decode())


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
