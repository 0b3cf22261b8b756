"""The run part of a step: one forward of the model over every scheduled piece, packed in
one row (``kvtier.hf.PackedCache``: different lengths, no padding).

``ModelRunner.run`` mutates the pieces' caches (the forward appends their tokens and seals
chunks into the tiers) and nothing else. Worker thread only.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Any, NamedTuple

import torch

from kvtier.engine.sequence import Piece, Sequence
from kvtier.hf import PackedCache
from kvtier.runtime import SequenceKV


class Sampled(NamedTuple):
    """What a forward gives the postprocess.

    Attributes:
        seqs: the sequences to sample (decoding ones, and prefills' last pieces), in the
            order of ``logits``' rows.
        logits: ``[len(seqs), V]`` (one row, unused, when nothing is sampled).
    """

    seqs: list[Sequence]
    logits: torch.Tensor


class ModelRunner:
    """Runs the model for the scheduler.

    Args:
        model: a transformers causal LM whose attention is kvtier's (``kvtier.hf.attach``).
        device: where its inputs go.
    """

    def __init__(self, model: Any, device: torch.device) -> None:
        self.model = model
        self.device = device

    def run(self, work: Seq[Piece]) -> Sampled:
        """One forward over every piece's ids; every piece's sequence holds a cache.

        Raises what the forward raises (the caches' state is then unknown)."""
        ids: list[int] = []
        positions: list[int] = []
        logit_rows: list[int] = []  # packed index of each sampled sequence's last token
        sampled: list[Sequence] = []
        caches: list[SequenceKV] = []
        for seq, start, stop in work:
            cache = seq.cache
            assert cache is not None
            caches.append(cache)
            ids.extend(seq.ids[start:stop])
            positions.extend(range(cache.seq_len, cache.seq_len + stop - start))
            if seq.decoding or not seq.pieces:
                logit_rows.append(len(ids) - 1)
                sampled.append(seq)
        batch = PackedCache(caches, [stop - start for _, start, stop in work])
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
