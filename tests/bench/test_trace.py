"""``kvbench.trace``: reading the trace, conversations, the sampled window, token ids
and scaling, and how much prefix a window shares."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from kvbench.trace import (
    DEFAULT_TRACE,
    TOKEN_ID_RANGE,
    Scaling,
    TraceRecord,
    block_ids,
    build_window,
    conversation_ids,
    keeps_conversation,
    load_trace,
    prompt_ids,
    sample_window,
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


def test_default_trace_is_committed_and_reads_whole() -> None:
    assert DEFAULT_TRACE.parents[1] == Path(__file__).resolve().parents[2] / "benchmarks"
    trace = load_trace(DEFAULT_TRACE)
    assert len(trace) == 12_031  # the Mooncake conversation trace, every request
    assert all(r.hash_ids[0] == 0 for r in trace)  # every request opens with block 0
    assert all(len(r.hash_ids) == math.ceil(r.input_length / 512) for r in trace)


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
