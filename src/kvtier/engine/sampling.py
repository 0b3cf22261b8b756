"""Picking the next token, and turning tokens into text that respects stop strings.

``sample`` is a pure function of the logits, the parameters and the request's own
``torch.Generator``: the same seed gives the same tokens whatever else the engine runs.
``TextStream`` detokenizes incrementally and cuts the output at the first stop string,
holding back only the text that could still become one.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from kvtier.engine.request import SamplingParams, TokenLogprobs

# Prompt tokens decoded ahead of the output, so the first output token gets the spacing it
# has in context (SentencePiece tokenizers drop a leading space when decoding alone).
_CONTEXT_TOKENS = 5


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """A request's own random generator; ``seed=None`` draws a fresh seed."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed if seed is not None else secrets.randbits(63))
    return generator


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Set the logits outside top-k and top-p to -inf; ``[..., V]`` in, same shape out.

    Top-p keeps the smallest set of most likely tokens whose probability reaches ``top_p``;
    the most likely token is always kept, so a ``top_p`` that rounds to 0 in the logits'
    dtype still leaves one token. ``top_k=0`` and ``top_p=1`` keep everything.
    """
    out = logits.clone()
    vocab = out.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(out, top_k, dim=-1).values[..., -1:]  # [..., 1]
        out = out.masked_fill(out < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(out, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the more likely ones already reach top_p.
        drop_sorted = probs.cumsum(dim=-1) - probs >= top_p
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        out = out.masked_fill(drop, float("-inf"))
    return out


def sample(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None
) -> int:
    """The next token from ``logits [V]``: argmax at temperature 0, else a seeded draw.

    The draw inverts the distribution's cumulative weight at one uniform number from
    ``generator`` (float64): the first token whose cumulative weight exceeds it, so a token
    of weight 0 (filtered out) is never drawn. It runs in numpy on float64 weights
    ``exp((logits - max) / temperature)`` (``_draw``), one core: torch's ops over the
    49,152-token vocabulary each opened an OpenMP region, which from the engine's thread
    wakes a sleeping helper, and sampling took 4 % of the engine thread under vLLM's
    serving client (0.7 ms a token; py-spy, 2-core AMD EPYC).

    Cannot fail for any ``SamplingParams`` that validated: the logits are shifted so the
    largest is 0 before dividing by the temperature (a tiny temperature sends the others to
    -inf, never to NaN), and filtering always keeps the most likely token.
    """
    cpu32 = logits.is_cpu and logits.dtype == torch.float32
    if params.greedy:
        if cpu32:
            # numpy's argmax (the first maximum, as torch's): 4 us against torch's 47 us
            # over 49,152 logits, whose OpenMP region wakes a second thread (2-core AMD EPYC)
            return int(logits.detach().numpy().argmax())
        return int(torch.argmax(logits))
    flat = logits.detach().reshape(-1)  # copied once below: the caller's logits stay
    scaled = (
        flat.numpy().astype(np.float64)
        if cpu32
        else flat.to("cpu", torch.float64, copy=True).numpy()
    )
    scaled -= scaled.max()  # <= 0, the argmax at exactly 0
    with np.errstate(over="ignore"):  # a tiny temperature: the others go to -inf
        scaled /= params.temperature
    if params.top_k or params.top_p < 1.0:
        scaled = filter_logits(torch.from_numpy(scaled), params.top_k, params.top_p).numpy()
    point = float(torch.rand(1, generator=generator, dtype=torch.float64))
    return _draw(np.exp(scaled), point)


_DRAW_BLOCK = 128
"""Weights summed a block at a time by ``_draw`` before the one block is walked."""


def _draw(weights: np.ndarray, uniform: float) -> int:
    """The first index whose cumulative weight exceeds ``uniform`` (in [0, 1)) times the
    total, for float64 ``weights`` >= 0 with a positive total: the blocks' sums locate the
    block, then that block's running sum the index (49,152 weights: ~30 us, where one
    cumulative sum over all of them takes 165). An index past the end, which only rounding
    can give, falls back to the last positive weight before it."""
    starts = np.arange(0, weights.shape[0], _DRAW_BLOCK)
    blocks = np.cumsum(np.add.reduceat(weights, starts))
    point = uniform * blocks[-1]
    block = int(np.searchsorted(blocks, point, side="right"))
    if block >= blocks.shape[0]:
        return int(np.flatnonzero(weights)[-1])
    start = int(starts[block])
    part = weights[start : start + _DRAW_BLOCK]
    before = float(blocks[block - 1]) if block else 0.0
    index = int(np.searchsorted(before + np.cumsum(part), point, side="right"))
    if index >= part.shape[0]:
        return start + int(np.flatnonzero(part)[-1])
    return start + index


def token_logprobs(logits: torch.Tensor, token: int, top: int) -> TokenLogprobs:
    """``token``'s log-probability under ``logits [V]`` (log-softmax in float32) and the
    ``top`` most likely tokens' (ties in id order)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [V]
    best = torch.topk(logprobs, top, dim=-1) if top else None
    pairs = (
        tuple(zip(best.indices.tolist(), best.values.tolist(), strict=True))
        if best is not None
        else ()
    )
    return TokenLogprobs(float(logprobs[token]), pairs)


class TextStream:
    """Incremental detokenizer with stop strings, for one request.

    ``push`` takes each generated token and returns the text that can be shown now: whole
    characters only, and never text that may still turn out to start a stop string. Once a
    stop string appears, the output is cut before it and ``stopped`` is True.

    Args:
        tokenizer: a transformers tokenizer.
        stop: the stop strings.
        prompt_ids: the prompt (its last tokens give the first output token its context).
    """

    def __init__(
        self, tokenizer: Any, stop: Sequence[str] = (), prompt_ids: Sequence[int] = ()
    ) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self._longest_stop = max((len(s) for s in self.stop), default=0)
        context = list(prompt_ids[-_CONTEXT_TOKENS:])
        self._ids: list[int] = context
        self._prefix_offset = 0  # decoding starts here (context for the next piece)
        self._read_offset = len(context)  # tokens before this are already in ``text``
        self.text = ""  # the output text decoded so far
        self.sent = 0  # characters of ``text`` already returned
        self.stopped = False

    def push(self, token_id: int) -> str:
        """Add a generated token; returns the newly showable text (possibly empty)."""
        if self.stopped:
            return ""
        self._ids.append(token_id)
        before = len(self.text)
        self.text += self._decode_new()
        if not self.stop:
            return self._take(len(self.text))
        # A new match must end in the new text, so it starts at most one stop length back.
        search_from = max(0, before - self._longest_stop + 1)
        hits = [i for i in (self.text.find(s, search_from) for s in self.stop) if i >= 0]
        if hits:
            cut = min(hits)
            self.stopped = True
            self.text = self.text[:cut]
            return self._take(cut)
        return self._take(len(self.text) - self._partial_stop_len())

    def flush(self) -> str:
        """The held-back text, at the end of a request that did not hit a stop string."""
        return self._take(len(self.text))

    def _take(self, end: int) -> str:
        end = max(end, self.sent)
        delta = self.text[self.sent : end]
        self.sent = end
        return delta

    def _decode_new(self) -> str:
        decode = self.tokenizer.decode
        prefix = decode(
            self._ids[self._prefix_offset : self._read_offset], skip_special_tokens=True
        )
        full = decode(self._ids[self._prefix_offset :], skip_special_tokens=True)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""  # nothing new, or the token ends inside a UTF-8 character: wait
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return full[len(prefix) :]

    def _partial_stop_len(self) -> int:
        """Length of the longest end of ``text`` that is the start of a stop string."""
        longest = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(self.text)), longest, -1):
                if self.text.endswith(s[:k]):
                    longest = k
                    break
        return longest


def eos_ids(model: Any, tokenizer: Any) -> frozenset[int]:
    """End-of-sequence ids: the generation config's (one or a list) and the tokenizer's."""
    ids: set[int] = set()
    generation = getattr(model, "generation_config", None)
    configured = getattr(generation, "eos_token_id", None)
    if isinstance(configured, int):
        ids.add(configured)
    elif isinstance(configured, (list, tuple)):
        ids.update(int(t) for t in configured)
    if isinstance(getattr(tokenizer, "eos_token_id", None), int):
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)
