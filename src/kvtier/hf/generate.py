"""Generation helpers: reuse a cached prefix, prefill in chunk-sized pieces, then generate.

``generate(model, cache, input_ids, ...)`` is ``model.generate`` with kvtier's two
additions: the longest prefix of the prompt already cached in any tier is adopted instead of
recomputed (``TieredCache.reuse_prefix``), and the rest of the prompt is prefilled in pieces
that end on chunk boundaries, so every piece seals whole chunks and the transient K/V of a
layer never exceeds one piece. ``model.generate`` then computes the last prompt token and
decodes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
from tqdm.auto import tqdm

from kvtier.hf.cache import TieredCache


@dataclass(frozen=True)
class GenerateResult:
    """Output of ``generate``.

    Attributes:
        sequences: ``[B, S + new]`` prompt and generated ids.
        reused_tokens: prompt tokens adopted from the tiers instead of computed.
        ttft_s: seconds from the call to the first generated token.
        decode_s: seconds from the first to the last generated token.
        new_tokens: tokens generated per row.
    """

    sequences: torch.Tensor
    reused_tokens: int
    ttft_s: float
    decode_s: float
    new_tokens: int

    @property
    def decode_tokens_per_s(self) -> float:
        steps = self.new_tokens - 1
        return steps / self.decode_s if steps > 0 and self.decode_s > 0 else 0.0


class TokenClock:
    """A transformers streamer that timestamps the prompt and each generated step."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: torch.Tensor) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        return None


@torch.no_grad()
def prefill(
    model: torch.nn.Module,
    cache: TieredCache,
    input_ids: torch.Tensor,
    progress: bool = False,
) -> int:
    """Fill ``cache`` with the prompt's whole chunks but the last; returns the tokens reused.

    Reuses the longest cached prefix when the cache is empty, then runs forward passes over
    whole chunks. What is left (at most one chunk plus the last token) is for the first
    forward of ``model.generate``, so no pass is spent on a handful of tokens.
    """
    ids = input_ids if input_ids.dim() == 2 else input_ids.unsqueeze(0)
    reused = cache.reuse_prefix(ids) if cache.seq_len == 0 else 0
    size = cache.layout.chunk_tokens
    end = ((ids.shape[1] - 1) // size) * size  # the last chunk boundary before the last token
    bounds = []
    pos = cache.seq_len
    while pos < end:  # pieces end on chunk boundaries, so each seals whole chunks
        stop = (pos // size + 1) * size
        bounds.append((pos, stop))
        pos = stop
    device = _device_of(model)
    bar = tqdm(total=max(0, end - cache.seq_len), desc="prefill", unit="tok", disable=not progress)
    with bar:
        for start, stop in bounds:
            model(ids[:, start:stop].to(device), cache=cache, use_cache=True)
            bar.update(stop - start)
    return reused


def generate(
    model: torch.nn.Module,
    cache: TieredCache,
    input_ids: torch.Tensor,
    progress: bool = False,
    **generate_kwargs: Any,
) -> GenerateResult:
    """Reuse, prefill in pieces, then ``model.generate``; one prompt row (batch 1) or more
    rows without padding. ``generate_kwargs`` go to ``model.generate``. With one row, the
    tail's whole pages are stored as a partial chunk at the end (``SequenceKV.seal_partial``),
    so a next turn recomputes less than a page past the reused chunks."""
    start = time.perf_counter()
    reused = prefill(model, cache, input_ids, progress=progress)
    result = _timed_generate(model, cache, input_ids, start, reused, generate_kwargs)
    if cache.kv.state.rows == 1:
        cache.kv.seal_partial()  # the next turn reuses the tail's whole pages too
    return result


def generate_resident(
    model: torch.nn.Module, input_ids: torch.Tensor, **generate_kwargs: Any
) -> GenerateResult:
    """The baseline: ``model.generate`` with transformers' ``DynamicCache``, all resident."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)  # type: ignore[arg-type]
    return _timed_generate(model, cache, input_ids, time.perf_counter(), 0, generate_kwargs)


@torch.no_grad()
def _timed_generate(
    model: torch.nn.Module,
    cache: Any,
    input_ids: torch.Tensor,
    start: float,
    reused: int,
    generate_kwargs: dict[str, Any],
) -> GenerateResult:
    clock = TokenClock()
    ids = input_ids if input_ids.dim() == 2 else input_ids.unsqueeze(0)
    out = model.generate(  # type: ignore[operator]
        ids.to(_device_of(model)),
        attention_mask=torch.ones_like(ids),
        cache=cache,
        streamer=clock,
        **generate_kwargs,
    )
    new_tokens = out.shape[1] - ids.shape[1]
    # clock.times[0] is the prompt, [1] the first generated token, [-1] the last.
    first = clock.times[1] if len(clock.times) > 1 else time.perf_counter()
    last = clock.times[-1] if len(clock.times) > 1 else first
    return GenerateResult(out, reused, first - start, last - first, new_tokens)


def _device_of(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device
