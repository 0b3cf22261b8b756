"""Checks a request must pass before it is queued: cheap, and each names the field to fix.

Pure functions of the request and the engine's limits; they mutate nothing and are safe
from any thread.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.config import MiB
from kvtier.engine.request import ContextLengthError, ParamError, SamplingParams


@dataclass(frozen=True)
class Limits:
    """What one sequence may use.

    Attributes:
        vocab_size: token ids must be below this.
        max_model_len: prompt plus output tokens, at most.
        chunk_tokens: tokens per KV chunk.
        chunk_nbytes: bytes per KV chunk.
        device_slots: chunks one sequence's device tier holds (0: none reserved).
        host_slots: chunks the host tier holds.
    """

    vocab_size: int
    max_model_len: int
    chunk_tokens: int
    chunk_nbytes: int
    device_slots: int
    host_slots: int


def check_prompt_length(num_tokens: int, limits: Limits) -> None:
    """Refuse a prompt that alone fills the context (before its ids are looked at).

    Raises:
        ContextLengthError: naming the sizes.
    """
    if num_tokens >= limits.max_model_len:
        raise ContextLengthError(
            "prompt",
            f"this model's maximum context length is {limits.max_model_len} tokens, but the "
            f"prompt alone has {num_tokens}; shorten the prompt",
        )


def check_fits(ids: tuple[int, ...], params: SamplingParams, limits: Limits) -> None:
    """Refuse a request the model or the tiers cannot serve.

    Raises:
        ParamError: a token id outside the vocabulary.
        ContextLengthError: prompt plus ``max_tokens`` exceed the context, or a sequence
            that long cannot be held by the tiers even alone.
    """
    if max(ids) >= limits.vocab_size:
        raise ParamError(
            "prompt", f"token id {max(ids)} is outside the vocabulary (size {limits.vocab_size})"
        )
    total = len(ids) + params.max_tokens
    check_tiers_hold(total, "prompt" if len(ids) >= total // 2 else "max_tokens", limits)
    if total > limits.max_model_len:
        raise ContextLengthError(
            "prompt" if len(ids) >= limits.max_model_len else "max_tokens",
            f"this model's maximum context length is {limits.max_model_len} tokens, but "
            f"{total} were requested ({len(ids)} in the prompt, {params.max_tokens} for "
            "the output); shorten the prompt or lower max_tokens",
        )


def check_tiers_hold(total_tokens: int, field: str, limits: Limits) -> None:
    """Refuse up front a sequence whose KV the tiers cannot hold even alone.

    When a sequence's sealed chunks outgrow its device tier, the rest stream from the host
    tier, where every sealed chunk is written and a forward pins the streamed ones all at
    once (a disk tier only refills the host): then all of its sealed chunks must fit in the
    host tier together.

    Raises:
        ContextLengthError: naming the sizes and the fix.
    """
    sealed = total_tokens // limits.chunk_tokens
    device, host, chunk = limits.device_slots, limits.host_slots, limits.chunk_nbytes
    if sealed > device and sealed > host:
        raise ContextLengthError(
            field,
            f"{total_tokens} tokens are {sealed} chunks ({sealed * chunk / MiB:.1f} MiB), "
            f"more than the per-sequence device budget holds ({device} chunks), so "
            f"they must fit in the host tier, which holds {host} chunks "
            f"({host * chunk / MiB:.1f} MiB); enlarge the host tier or the device "
            "budget, or shorten the request",
        )
