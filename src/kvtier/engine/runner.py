"""The run part of a step: one forward of the model over every scheduled piece, packed in
one row (different lengths, no padding).

Two runners with one interface (``run``, ``warm_up``, ``name``): ``LlamaRunner`` runs
kvtier's own forward for the Llama family (``kvtier.engine.llama``) and drives each
sequence's KV directly; ``ModelRunner`` runs any other architecture through transformers'
modelling and ``kvtier.hf.PackedCache``. ``make_runner`` picks one by architecture. ``run``
mutates the pieces' caches (the forward appends their tokens and seals chunks into the
tiers) and nothing else. Worker thread only.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from kvtier import native
from kvtier.engine.llama import LlamaModel
from kvtier.engine.sequence import Piece, Sequence
from kvtier.hf import PackedCache, begin_packed
from kvtier.kv.layout import dtype_name
from kvtier.runtime import SequenceKV

RUNNERS = ("auto", "kvtier", "transformers")
"""``EngineConfig.runner``: ``auto`` takes kvtier's own forward where the architecture has
it, ``kvtier`` requires it, ``transformers`` always uses transformers' modelling."""


class Sampled(NamedTuple):
    """What a forward gives the postprocess.

    Attributes:
        seqs: the sequences to sample (decoding ones, and prefills' last pieces), in the
            order of ``logits``' rows.
        logits: ``[len(seqs), V]`` (one row, unused, when nothing is sampled).
    """

    seqs: list[Sequence]
    logits: torch.Tensor


@dataclass
class Packed:
    """A step's pieces packed end to end in one row.

    Attributes:
        ids: every piece's tokens, in order.
        positions: each token's position in its sequence.
        logit_rows: the packed index of each sampled sequence's last token.
        sampled: the sequences to sample (decoding ones, and prefills' last pieces).
        caches: each piece's sequence KV, in packed order.
        spans: each piece's ``(start, length)`` in the row.
    """

    ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    logit_rows: list[int] = field(default_factory=list)
    sampled: list[Sequence] = field(default_factory=list)
    caches: list[SequenceKV] = field(default_factory=list)
    spans: list[tuple[int, int]] = field(default_factory=list)


def pack(work: Seq[Piece]) -> Packed:
    """Pack the pieces of a step; every piece's sequence holds a cache. Pure."""
    step = Packed()
    for seq, start, stop in work:
        cache = seq.cache
        assert cache is not None
        step.spans.append((len(step.ids), stop - start))
        step.caches.append(cache)
        step.ids.extend(seq.ids[start:stop])
        step.positions.extend(range(cache.seq_len, cache.seq_len + stop - start))
        if seq.decoding or not seq.pieces:
            step.logit_rows.append(len(step.ids) - 1)
            step.sampled.append(seq)
    return step


def argmax_only(seq: Sequence) -> bool:
    """Whether ``seq``'s next token reads only its logits' first maximum: greedy, with no
    log-probabilities (``kvtier.engine.sampling.sample``, ``postprocess``)."""
    params = seq.handle.request.params
    return params.greedy and params.logprobs is None


def seat_order(work: Seq[Piece]) -> list[Piece]:
    """The pieces with the one-token pieces of seated sequences first, by seat; the others
    after them in their order. Pure."""

    seated: list[tuple[int, Piece]] = []
    rest: list[Piece] = []
    for piece in work:
        seq, start, stop = piece
        where = seq.cache.arena.seat if seq.cache is not None else None
        if stop - start == 1 and where is not None:
            seated.append((where[1], piece))
        else:
            rest.append(piece)
    seated.sort(key=lambda item: item[0])
    return [piece for _, piece in seated] + rest


class ModelRunner:
    """Runs the model through transformers' modelling for the scheduler.

    Args:
        model: a transformers causal LM whose attention is kvtier's (``kvtier.hf.attach``).
        device: where its inputs go.
    """

    name = "transformers"

    def __init__(self, model: Any, device: torch.device) -> None:
        self.model = model
        self.device = device

    def run(self, work: Seq[Piece]) -> Sampled:
        """One forward over every piece's ids; every piece's sequence holds a cache.

        Raises what the forward raises (the caches' state is then unknown)."""
        step = pack(work)
        ids, positions, logit_rows, caches = step.ids, step.positions, step.logit_rows, step.caches
        sampled = step.sampled
        batch = PackedCache(caches, [count for _, count in step.spans])
        device = self.device
        out = self.model(
            torch.tensor([ids], dtype=torch.long, device=device),
            position_ids=torch.tensor([positions], dtype=torch.long, device=device),
            cache=batch,
            use_cache=True,
            logits_to_keep=torch.tensor(logit_rows or [len(ids) - 1], device=device),
        )
        return Sampled(sampled, out.logits[0])  # [len(logit_rows), V]

    def warm_up(self, num_tokens: int) -> None:
        """One throw-away forward of ``num_tokens`` with no cache, before any request.

        Like a GPU server's profiling run at start: the allocator then holds buffers of the
        step's activation sizes, so the first requests do not pay the first touch of fresh
        memory (about 2 s of a 4K-token step's 6.8 s on a 2-core CPU).
        """
        ids = torch.zeros(1, num_tokens, dtype=torch.long, device=self.device)
        with torch.no_grad():
            self.model(ids, use_cache=False, logits_to_keep=1)


class LlamaRunner:
    """Runs kvtier's own Llama-family forward for the scheduler (same interface as
    ``ModelRunner``).

    Args:
        model: a transformers Llama-family causal LM (``LlamaModel.supports``).
        device: where its inputs go.
        matmul_dtype: the projections' dtype (``LlamaModel``); None: the weights'.
    """

    def __init__(
        self, model: Any, device: torch.device, matmul_dtype: torch.dtype | None = None
    ) -> None:
        self.llama = LlamaModel(model, matmul_dtype)
        self.device = device
        kernels = native.status().line() if self.llama.ops is not None else "torch's ops"
        low = "" if matmul_dtype is None else f"; projections in {dtype_name(matmul_dtype)}"
        self.name = f"kvtier (llama family; {kernels}{low}{self.llama.codes_line()})"

    def run(self, work: Seq[Piece]) -> Sampled:
        """One forward over every piece's ids; every piece's sequence holds a cache.

        Each sequence's pass begins before the forward and ends after it; a forward that
        raises drops every pass begun (nothing sealed), and the error propagates. One-token
        pieces of seated sequences go first, in seat order, so the step's decode rows
        ``0..R-1`` are seats ``0..R-1`` whenever those are the decoding ones
        (``kvtier.runtime.DecodeBatch``: no gather, no scatter)."""
        step = pack(seat_order(work))
        ids, positions, logit_rows, caches = step.ids, step.positions, step.logit_rows, step.caches
        sampled, spans = step.sampled, step.spans
        device = self.device
        packed = torch.tensor(ids, dtype=torch.long)
        begin_packed(caches, spans, packed[None])
        try:
            logits = self.llama.forward(
                packed.to(device),
                torch.tensor(positions, dtype=torch.long, device=device),
                caches,
                spans,
                torch.tensor(logit_rows or [len(ids) - 1], device=device),
                argmax_only=bool(sampled) and all(argmax_only(seq) for seq in sampled),
            )
        except BaseException:
            for cache in caches:
                cache.drop_forward()
            raise
        for cache in caches:
            cache.end_forward()
        return Sampled(sampled, logits)

    def warm_up(self, num_tokens: int) -> None:
        """One throw-away forward of ``num_tokens`` with no KV (see ``ModelRunner.warm_up``)."""
        ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        positions = torch.arange(num_tokens, device=self.device)
        last = torch.tensor([num_tokens - 1], device=self.device)
        self.llama.forward(ids, positions, None, [(0, num_tokens)], last)


def make_runner(
    model: Any,
    device: torch.device,
    choice: str = "auto",
    matmul_dtype: torch.dtype | None = None,
) -> ModelRunner | LlamaRunner:
    """The runner for ``model``: kvtier's own forward where the architecture has it (unless
    ``choice`` is ``transformers``), else transformers' modelling. ``matmul_dtype`` (only
    kvtier's forward has it): the projections' dtype.

    Raises:
        ValueError: ``choice`` is ``kvtier`` and the model does not have the shape (why),
            ``choice`` is not one of ``RUNNERS``, or ``matmul_dtype`` is asked of a model
            that transformers' modelling runs.
    """
    if choice not in RUNNERS:
        raise ValueError(f"runner: unknown {choice!r}; accepted: {list(RUNNERS)}")
    reason = "runner 'transformers' chosen" if choice == "transformers" else None
    reason = reason or LlamaModel.why_not(model)
    if reason is None:
        return LlamaRunner(model, device, matmul_dtype)
    if choice == "kvtier":
        raise ValueError(f"runner: kvtier's own forward cannot run this model: {reason}")
    if matmul_dtype is not None:
        raise ValueError(f"matmul_dtype: only kvtier's own forward has it ({reason})")
    return ModelRunner(model, device)
