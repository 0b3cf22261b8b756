"""The trace side of ``kvtier bench serve``: a Mooncake-format trace read, grouped into
conversations, sampled into a window and turned into replay requests of token ids.

Contract: pure functions of the trace file and their arguments (no servers, no clients, no
clocks); the same trace, seed and scaling give the same window, token for token. Each
512-token trace block id becomes a fixed block of ``Scaling.block_tokens`` token ids drawn
from a generator seeded with the id, so equal leading ids are equal leading tokens. Bad
arguments raise ``ValueError`` naming the benchmark's flag; a missing trace raises
``FileNotFoundError`` naming ``--trace``.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.tracefile import open_trace

# The Mooncake conversation trace, committed compressed (its README names the source).
DEFAULT_TRACE = Path(__file__).resolve().parents[1] / "traces" / "conversation_trace.jsonl.xz"
TRACE_BLOCK_TOKENS = 512  # tokens per hash id in the trace
# Ids drawn for the blocks: below 30000, so any llama-family vocabulary (>= 32000) holds them,
# and above the special and byte tokens.
TOKEN_ID_RANGE = (1000, 30000)


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
    records: list[TraceRecord] = []
    with open_trace(path) as f:
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
