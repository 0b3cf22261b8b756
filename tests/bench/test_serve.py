"""``kvtier bench serve``: trace parsing and scaling, the client, metrics and the summary."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest

from kvtier.bench import BENCHMARKS
from kvtier.bench.serve import (
    DEFAULT_TRACE,
    TOKEN_ID_RANGE,
    ReplayRequest,
    Reply,
    Scaling,
    TraceRecord,
    block_ids,
    build_window,
    conversation_ids,
    keeps_conversation,
    load_trace,
    main,
    metric_figures,
    parse_args,
    parse_metrics,
    percentile,
    prompt_ids,
    reply_figures,
    same_texts,
    sample_window,
    server_configs,
    stream_completion,
    summarize,
    window_sharing,
)

SCALE = Scaling(block_tokens=8, max_prompt_tokens=64, max_output_tokens=4, time_factor=2.0)


def record(
    ms: int, blocks: list[int], input_length: int | None = None, out: int = 10
) -> TraceRecord:
    length = 512 * len(blocks) if input_length is None else input_length
    return TraceRecord(ms, length, out, tuple(blocks))


# A system prompt (block 0), a conversation 0 → 2 that extends itself, and two loners.
TRACE = [
    record(0, [0, 1, 2]),
    record(1000, [0, 3], input_length=600),
    record(5000, [0, 1, 2, 4]),
    record(6000, [0]),
]


def test_the_benchmarks_are_registered() -> None:
    assert "serve" in BENCHMARKS and "multiturn" in BENCHMARKS


def test_default_trace_path_is_the_shared_folder_beside_the_repository() -> None:
    assert DEFAULT_TRACE.parts[-3:] == ("shared", "traces", "conversation_trace.jsonl")
    assert DEFAULT_TRACE.parents[2] == Path(__file__).resolve().parents[3]


def test_load_trace_reads_records_and_names_what_is_wrong(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    rows = [
        {"timestamp": 0, "input_length": 700, "output_length": 3, "hash_ids": [0, 1]},
        {"timestamp": 9, "input_length": 10, "output_length": 1, "hash_ids": [0]},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + "\n")
    assert load_trace(path) == [TraceRecord(0, 700, 3, (0, 1)), TraceRecord(9, 10, 1, (0,))]
    with pytest.raises(FileNotFoundError, match="--trace"):
        load_trace(tmp_path / "missing.jsonl")
    path.write_text('{"timestamp": 0}\n')
    with pytest.raises(ValueError, match=r"trace\.jsonl:1"):
        load_trace(path)


def test_conversations_share_more_than_the_system_prompt() -> None:
    assert conversation_ids(TRACE) == [0, 1, 0, 3]


def test_conversation_sample_is_seeded_and_fraction_one_is_a_consecutive_window() -> None:
    assert sample_window(TRACE, 3, 1.0, seed=5) == [0, 1, 2]
    kept = [keeps_conversation(c, 0.5, seed=1) for c in range(200)]
    assert kept == [keeps_conversation(c, 0.5, seed=1) for c in range(200)]
    assert 60 < sum(kept) < 140
    assert kept != [keeps_conversation(c, 0.5, seed=2) for c in range(200)]
    # A window holds every turn of each kept conversation up to its last request.
    trace = [record(i, [0, 100 + i % 20, 200 + i]) for i in range(100)]  # 20 of 5 turns
    window = sample_window(trace, 12, 0.3, seed=0)
    conversations = conversation_ids(trace)
    kept = {c for c in conversations if keeps_conversation(c, 0.3, seed=0)}
    assert window == [i for i in range(window[-1] + 1) if conversations[i] in kept]
    assert len({conversations[i] for i in window}) < len(window)  # some conversations recur


@pytest.mark.parametrize(
    ("requests", "fraction", "message"),
    [(0, 1.0, "--requests"), (2, 0.0, "--user-fraction"), (2, 1.5, "--user-fraction")],
)
def test_sample_window_rejects_bad_arguments(requests: int, fraction: float, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        sample_window(TRACE, requests, fraction, seed=0)


def test_sample_window_too_small_says_which_flag_to_raise() -> None:
    with pytest.raises(ValueError, match="--user-fraction"):
        sample_window(TRACE, 5, 1.0, seed=0)


def test_block_ids_are_fixed_by_the_id() -> None:
    a = block_ids(7, 32)
    assert np.array_equal(a, block_ids(7, 32))
    assert not np.array_equal(a, block_ids(8, 32))
    assert a.min() >= TOKEN_ID_RANGE[0] and a.max() < TOKEN_ID_RANGE[1]


def test_prompts_scale_blocks_and_share_exactly_the_shared_blocks() -> None:
    first, extended = prompt_ids(TRACE[0], SCALE), prompt_ids(TRACE[2], SCALE)
    assert len(first) == 24 and len(extended) == 32  # 3 and 4 blocks of 8
    assert extended[:24] == first
    short = prompt_ids(TRACE[1], SCALE)  # 600 of 512-token blocks → ceil(600 × 8 / 512) = 10
    assert len(short) == 10 and short[:8] == first[:8] and short[8:] != first[8:10]
    capped = prompt_ids(record(0, list(range(20))), SCALE)
    assert len(capped) == SCALE.max_prompt_tokens


def test_window_compresses_time_and_caps_outputs() -> None:
    window = build_window(TRACE, [1, 2, 3], SCALE)
    assert [r.arrival_s for r in window] == [0.0, 2.0, 2.5]
    assert [r.index for r in window] == [1, 2, 3]
    assert [r.conversation for r in window] == [1, 0, 3]
    assert all(r.max_tokens == SCALE.max_output_tokens for r in window)
    one = build_window([record(0, [0], out=0)], [0], SCALE)[0]
    assert one.max_tokens == 1


@pytest.mark.parametrize(
    ("field", "flag"),
    [("block_tokens", "--block-tokens"), ("max_output_tokens", "--max-output-tokens")],
)
def test_scaling_names_the_flag(field: str, flag: str) -> None:
    kwargs = dict(block_tokens=8, max_prompt_tokens=8, max_output_tokens=8, time_factor=1.0)
    with pytest.raises(ValueError, match=flag):
        Scaling(**{**kwargs, field: 0})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="--time-factor"):
        Scaling(**{**kwargs, "time_factor": 0.0})  # type: ignore[arg-type]


def test_window_sharing_counts_whole_chunks_an_unbounded_cache_would_serve() -> None:
    sharing = window_sharing(build_window(TRACE, [0, 1, 2, 3], SCALE), chunk_tokens=8)
    # #1 shares block 0 (8); #2 shares blocks 0-2 (24), its last block is new; #3 is one
    # block, and reuse always leaves the last token to compute, so it shares nothing.
    assert sharing["shareable_tokens"] == 32
    assert sharing["shareable_tokens_beyond_first_chunk"] == 16
    assert sharing["prompt_tokens"] == 24 + 10 + 32 + 8
    assert sharing["conversations"] == 3
    assert sharing["arrival_span_s"] == 3.0


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


def test_summary_ratios_are_against_device_only() -> None:
    headlines: dict[str, dict[str, float | None]] = {
        "device_only": {"reused_tokens": 100.0, "ttft_p50_s": 2.0},
        "device_host": {"reused_tokens": 250.0, "ttft_p50_s": 1.0},
        "device_host_disk": {"reused_tokens": 300.0, "ttft_p50_s": 0.5},
    }
    summary = summarize(headlines)
    assert summary["reused_tokens_ratio_vs_device_only"] == 3.0
    assert summary["ttft_p50_ratio_vs_device_only"] == 0.25
    assert summary["device_host_reused_tokens_ratio_vs_device_only"] == 2.5
    assert summary["device_host_ttft_p50_ratio_vs_device_only"] == 0.5
    assert summary["device_host_ttft_p50_s"] == 1.0
    headlines["device_only"]["reused_tokens"] = 0.0
    del headlines["device_host"]
    summary = summarize(headlines)
    assert summary["reused_tokens_ratio_vs_device_only"] is None
    assert summary["device_host_ttft_p50_ratio_vs_device_only"] is None


def test_same_texts_needs_every_run_to_agree() -> None:
    texts: dict[str, list[dict[int, str | None]]] = {
        "device_only": [{0: "a", 1: "b", 2: "c"}],
        "device_host": [{0: "a", 1: "x", 2: None}],
    }
    assert same_texts(texts) == (1, 3)
    assert same_texts({}) == (0, 0)


def test_server_configs_size_the_tiers_from_the_device_budget(tmp_path: Path) -> None:
    configs = server_configs(64, 4, 8.0, 4096, chunk_tokens=64, max_queued=80)
    assert list(configs) == ["device_only", "device_host", "device_host_disk"]
    assert configs["device_only"].host_mb == 256 and configs["device_only"].disk_mb is None
    assert configs["device_host"].host_mb == 2048 and configs["device_host"].disk_mb is None
    assert configs["device_host_disk"].host_mb == 256
    flags = configs["device_host_disk"].flags(tmp_path)
    assert flags[flags.index("--disk-dir") + 1] == str(tmp_path)
    assert "--disk-dir" not in configs["device_only"].flags(None)
    assert flags[flags.index("--max-batch-size") + 1] == "4"
    with pytest.raises(ValueError, match="folder"):
        configs["device_host_disk"].flags(None)
    with pytest.raises(ValueError, match="--host-factor"):
        server_configs(64, 4, 0.5, 4096, 64, 80)


def test_flags_are_checked_before_anything_starts(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--repeats"):
        parse_args(["--repeats", "0"])
    with pytest.raises(FileNotFoundError, match="--trace"):
        main(["--trace", str(tmp_path / "none.jsonl")])
    args = parse_args(["--quick"])
    assert (args.requests, args.max_prompt_tokens, args.max_output_tokens) == (8, 512, 8)


# ---- the streaming client against a scripted SSE server ---------------------------------------


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
