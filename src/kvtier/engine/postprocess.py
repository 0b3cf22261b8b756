"""The postprocess part of a step: sample a sequence's next token, stream it, and say
whether the sequence ends.

``postprocess`` mutates the sequence (``ids``, ``generated``, ``last_token_s``, its text
stream and generator), the metrics (tokens, latencies, finished or cancelled requests) and
puts one ``TokenEvent`` on the sequence's handle. Worker thread only.
"""

from __future__ import annotations

import time
from collections.abc import Container

import torch

from kvtier.engine.metrics import EngineMetrics
from kvtier.engine.request import FinishReason, TokenEvent, TokenLogprobs
from kvtier.engine.sampling import sample, token_logprobs
from kvtier.engine.sequence import Sequence


def postprocess(
    seq: Sequence, logits: torch.Tensor, eos_ids: Container[int], metrics: EngineMetrics
) -> FinishReason | None:
    """Sample ``seq``'s next token from its ``logits`` (``[V]``) with its own parameters
    and generator, and stream it; returns why the sequence ended (None: it goes on).

    Raises what sampling or detokenizing raises (the caller fails this sequence alone).
    """
    params = seq.handle.request.params
    token = sample(logits, params, seq.generator)
    logprobs = None if params.logprobs is None else token_logprobs(logits, token, params.logprobs)
    reason = emit(seq, token, logprobs, eos_ids, metrics)
    seq.generated += 1
    seq.ids.append(token)
    return reason


def emit(
    seq: Sequence,
    token: int,
    logprobs: TokenLogprobs | None,
    eos_ids: Container[int],
    metrics: EngineMetrics,
) -> FinishReason | None:
    """Stream ``seq``'s next generated token; returns why the sequence ended (None: it
    goes on). The finish is counted before the final event, so a caller that has seen the
    end finds it in ``Engine.stats``."""
    handle, text = seq.handle, seq.text
    params = handle.request.params
    step = seq.generated
    delta = text.push(token)
    reason: FinishReason | None = None
    if text.stopped or (token in eos_ids and not params.ignore_eos):
        reason = "stop"
    elif step + 1 == params.max_tokens:
        reason = "length"
    elif handle.cancelled:
        reason = "cancelled"
    if reason is not None and not text.stopped:
        delta += text.flush()
    now = time.perf_counter()
    last_s = seq.last_token_s if step else handle.request.arrival_s
    (metrics.ttft if step == 0 else metrics.inter_token).observe(now - last_s)
    seq.last_token_s = now
    metrics.add("generated_tokens")
    if reason is not None:
        metrics.add("cancelled" if reason == "cancelled" else "finished")
        metrics.observe_service(now - handle.request.arrival_s)
    handle.put(TokenEvent(handle.request_id, token, delta, reason is not None, reason, logprobs))
    return reason
