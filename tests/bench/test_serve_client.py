"""``kvbench.serve_client``: the streaming client and ``/metrics`` against a scripted
server, and the figures from replies and counters."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import numpy as np
import pytest

from kvbench.serve_client import (
    Reply,
    metric_figures,
    parse_metrics,
    percentile,
    reply_figures,
    scrape_metrics,
    stream_completion,
)
from kvbench.trace import ReplayRequest

METRICS_BEFORE = """# HELP kvtier_prompt_tokens_total prompt tokens
# TYPE kvtier_prompt_tokens_total counter
kvtier_prompt_tokens_total 100.0
kvtier_reused_tokens_total{tier="host"} 64.0
kvtier_tier_hits_total{tier="host"} 1.0
kvtier_tier_used_bytes{tier="host"} 5.0
"""
METRICS_AFTER = """kvtier_prompt_tokens_total 1100.0
kvtier_reused_tokens_total{tier="host"} 320.0
kvtier_reused_tokens_total{tier="disk"} 128.0
kvtier_tier_hits_total{tier="host"} 5.0
kvtier_tier_hits_total{tier="disk"} 2.0
kvtier_tier_used_bytes{tier="host"} 9.0
kvtier_time_to_first_token_seconds_bucket{le="0.5"} 3.0
"""


def test_parse_metrics_drops_total_and_keys_by_label() -> None:
    samples = parse_metrics(METRICS_AFTER)
    assert samples[("kvtier_prompt_tokens", "")] == 1100.0
    assert samples[("kvtier_reused_tokens", "disk")] == 128.0
    assert samples[("kvtier_time_to_first_token_seconds_bucket", "0.5")] == 3.0
    assert all(not name.startswith("#") for name, _ in samples)


def test_metric_figures_are_the_difference_between_scrapes() -> None:
    figures = metric_figures(parse_metrics(METRICS_BEFORE), parse_metrics(METRICS_AFTER))
    assert figures["prompt_tokens"] == 1000
    assert figures["reused_tokens_by_tier"] == {"disk": 128, "host": 256}
    assert figures["reused_tokens"] == 384
    assert figures["reused_fraction"] == pytest.approx(0.384)
    assert figures["tiers"]["host"] == {"hits": 4.0, "used_bytes_after": 9.0}
    assert figures["tiers"]["disk"] == {"hits": 2.0}


def test_percentile_matches_numpy_and_is_none_when_empty() -> None:
    values = [0.3, 0.1, 0.4, 0.15, 0.9, 0.2]
    for q in (0, 50, 90, 99, 100):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    assert percentile([], 50) is None


def test_reply_figures_count_failures_and_rate() -> None:
    replies = [
        Reply(0, 0.0, 10, ttft_s=1.0, gaps_s=[0.1, 0.3], completion_tokens=3, done_s=2.0),
        Reply(1, 1.0, 10, ttft_s=3.0, gaps_s=[0.2], completion_tokens=2, done_s=4.0),
        Reply(2, 1.5, 10, error="HTTP 429: b''", done_s=1.6),
    ]
    figures = reply_figures(replies)
    assert (figures["requests"], figures["ok"]) == (3, 2)
    assert figures["errors"] == ["#2: HTTP 429: b''"]
    assert figures["ttft_s"]["p50"] == 2.0
    assert figures["itl_s"]["p50"] == pytest.approx(0.2)
    assert figures["output_tokens_per_s"] == pytest.approx(5 / 4.0)


# ---- the streaming client and /metrics against a scripted server ------------------------------


class _Handler(BaseHTTPRequestHandler):
    script: ClassVar[list[str]] = []
    status: ClassVar[int] = 200

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert body["stream"] is True and body["prompt"] == [5, 6, 7]
        self.send_response(self.status)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for event in self.script:
            self.wfile.write(f"data: {event}\n\n".encode())
            self.wfile.flush()

    def do_GET(self) -> None:
        assert self.path == "/metrics"
        body = METRICS_AFTER.encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        return None


@pytest.fixture
def sse_port() -> Iterator[int]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield int(server.server_address[1])
    server.shutdown()
    server.server_close()


def chunk(text: str) -> str:
    return json.dumps({"choices": [{"index": 0, "text": text, "finish_reason": None}]})


REQUEST = ReplayRequest(index=3, conversation=0, arrival_s=0.0, prompt_ids=(5, 6, 7), max_tokens=3)


def test_client_times_chunks_and_reads_usage(sse_port: int) -> None:
    usage = {"completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 64}}
    _Handler.status = 200
    _Handler.script = [
        chunk("a"),
        chunk("b"),
        chunk("c"),
        json.dumps({"choices": [], "usage": usage}),
        "[DONE]",
    ]
    reply = stream_completion(sse_port, REQUEST, start=0.0, timeout_s=10)
    assert reply.error is None
    assert reply.text == "abc" and reply.ttft_s is not None and len(reply.gaps_s) == 2
    assert (reply.completion_tokens, reply.cached_tokens, reply.index) == (3, 64, 3)


def test_client_records_http_and_stream_errors(sse_port: int) -> None:
    _Handler.status = 200
    _Handler.script = [chunk("a"), json.dumps({"error": {"message": "boom"}}), "[DONE]"]
    assert stream_completion(sse_port, REQUEST, 0.0, 10).error == "boom"
    _Handler.status = 429
    _Handler.script = []
    assert (stream_completion(sse_port, REQUEST, 0.0, 10).error or "").startswith("HTTP 429")


def test_scrape_metrics_reads_and_parses_the_endpoint(sse_port: int) -> None:
    assert scrape_metrics(sse_port) == parse_metrics(METRICS_AFTER)
