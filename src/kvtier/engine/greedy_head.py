"""The LM head for rows that only need their most likely token: the same argmax as the full
float32 head, reading half its bytes.

A greedy row with no log-probabilities needs one thing of its logits: the first index of
their maximum. ``GreedyHead`` screens the whole vocabulary with a bfloat16 copy of the head
(``linear_panels`` on bf16 panels: 2 bytes a weight instead of 4, ``vdpbf16ps`` where the
CPU has it), bounds how far each screened logit can be from the float32 one, and computes
exactly (float32 ``linear_panels``, the full head's kernel) only the tokens the bound cannot
rule out: 1 in the median of decode steps on SmolLM2-135M, at most 28 in 120 steps measured.
For SmolLM2-135M the head is 113 MB of the 538 MB a batch-1 step reads.

The bound, for a row ``x`` (float32, rounded to ``x̂`` in bf16 by the screen kernel), a
vocabulary row ``w`` and its bf16 copy ``ŵ``, with ``γ = H u / (1 - H u)``, ``u = 2^-24``:

- the full head's logit ``L`` is within ``γ ||x|| ||w||`` of the real ``x·w`` (float32
  sums of ``H`` products, any order);
- the screen's ``A`` is within ``γ ||x̂|| ||ŵ||`` of the real ``x̂·ŵ`` (bf16 products are
  exact in float32), which is within ``||x̂ − x|| ||ŵ|| + ||x|| ||ŵ − w||`` of ``x·w``;

so ``|A − L| <= D = ||x̂−x|| P + ||x|| E + γ (||x|| W + (||x|| + ||x̂−x||) P)`` with the
per-token norms ``W = ||w||``, ``P = ||ŵ||``, ``E = ||ŵ − w||`` (float64, once at start),
inflated for the float64 arithmetic that evaluates it and for flushed denormals. A token
``j`` with ``A_j + D_j < max_i (A_i − D_i)`` then has ``L_j < L_m`` for the token ``m`` that
attains that maximum: it is neither the maximum nor tied with it. Every other token's
logit is computed by the full head's kernel on the same row, whose per-output arithmetic
does not depend on which outputs a call holds (each is one float32 FMA chain over ``k`` in
one lane), so its bits are the full head's and the first maximum is the same token.

``logits`` returns ``[R, V]`` with those exact logits and ``-inf`` elsewhere: the argmax
is the full head's; nothing else of the row is (the runner asks only for rows sampled
greedily without log-probabilities).

Thread-safety: ``logits`` reads the head and its norms only (safe from any thread).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

_UNIT_ROUNDOFF = 2.0**-24
"""float32's unit roundoff."""

_SLACK_REL = 1e-3
"""``D`` inflated by this fraction: covers evaluating it (and comparing) in float64."""

_NORM_ROWS = 4096
"""Vocabulary rows widened to float64 at a time while the norms are computed."""

_SLACK_ABS = 1e-30
"""And this much absolute: denormal products and inputs the bf16 kernel flushes to zero
(at most ``H`` of ``2^-126`` each, ~1e-35 for ``H`` = 576)."""


@dataclass(frozen=True)
class GreedyHead:
    """A float32 head ``weight [V, H]`` with its bf16 screen.

    Attributes:
        weight: the head (shared with the model, read-only): the candidates' rows.
        screen: ``pack_panels`` of its bf16 copy (``[P, H / 2, 16, 2]``).
        norm_w, norm_p, norm_e: ``[V]`` float64 ``||w||``, ``||ŵ||``, ``||ŵ − w||``.
        gamma: ``H u / (1 − H u)``.
        ops: kvtier's CPU kernels (``pack_panels``, ``linear_panels``).
    """

    weight: torch.Tensor
    screen: torch.Tensor
    norm_w: np.ndarray
    norm_p: np.ndarray
    norm_e: np.ndarray
    gamma: float
    ops: Any

    @classmethod
    def build(cls, weight: torch.Tensor, ops: Any) -> GreedyHead:
        """The screen of a contiguous float32 CPU ``weight [V, H]`` (a bf16 copy: half its
        bytes more memory). ``ops``: kvtier's CPU kernels."""
        if weight.dtype != torch.float32 or weight.dim() != 2 or not weight.is_cpu:
            raise ValueError("GreedyHead: the head must be a float32 CPU [V, H]")
        weight = weight.detach().contiguous()
        low = weight.to(torch.bfloat16)
        norms = np.empty((3, weight.shape[0]), dtype=np.float64)
        for start in range(0, weight.shape[0], _NORM_ROWS):  # float64 a slice at a time
            wide = weight[start : start + _NORM_ROWS].double()
            low64 = low[start : start + _NORM_ROWS].double()
            stop = start + wide.shape[0]
            norms[0, start:stop] = wide.norm(dim=1).numpy()
            norms[1, start:stop] = low64.norm(dim=1).numpy()
            norms[2, start:stop] = (low64 - wide).norm(dim=1).numpy()
        hidden = weight.shape[1]
        return cls(
            weight=weight,
            screen=ops.pack_panels(low),
            norm_w=norms[0],
            norm_p=norms[1],
            norm_e=norms[2],
            gamma=hidden * _UNIT_ROUNDOFF / (1 - hidden * _UNIT_ROUNDOFF),
            ops=ops,
        )

    def candidates(self, screened: np.ndarray, x: torch.Tensor) -> list[np.ndarray]:
        """Per row of ``x [R, H]``, the tokens whose float32 logit may be the row's maximum,
        given the screen's logits ``screened [R, V]`` (float32); sorted token ids."""
        x64 = x.double()
        norm_x = x64.norm(dim=1).numpy()
        norm_dx = (x.to(torch.bfloat16).double() - x64).norm(dim=1).numpy()
        wmax, pmax, emax = (float(a.max()) for a in (self.norm_w, self.norm_p, self.norm_e))
        out = []
        for r in range(screened.shape[0]):
            a = float(norm_dx[r] + self.gamma * (norm_x[r] + norm_dx[r]))  # times P
            b, c = float(norm_x[r]), float(self.gamma * norm_x[r])  # times E, W
            row = screened[r]
            top = float(row.max())
            if not math.isfinite(top):  # a NaN or inf logit: no bound holds, keep all
                out.append(np.arange(row.shape[0]))
                continue
            # every token's D is at most d_max: a first cut with one bound for the row
            d_max = (a * pmax + b * emax + c * wmax) * (1 + _SLACK_REL) + _SLACK_ABS
            cut = top - 2 * d_max - 1e-12 * abs(top)
            cut32 = np.float32(cut)
            if cut32 > cut:  # rounded up: one float32 lower, so the cut keeps no fewer
                cut32 = np.nextafter(cut32, np.float32(-np.inf))
            near = np.flatnonzero(row >= cut32)
            logit = row[near].astype(np.float64)
            d = (a * self.norm_p[near] + b * self.norm_e[near] + c * self.norm_w[near]) * (
                1 + _SLACK_REL
            ) + (_SLACK_ABS + 1e-12 * np.abs(logit))
            floor = float((logit - d).max())  # at most max_i (A_i - D_i) over all tokens
            out.append(near[logit + d >= floor])
        return out

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """``[R, V]`` float32 for ``x [R, H]`` (contiguous float32): the full head's logit
        at every token that may be its row's first maximum, ``-inf`` elsewhere. A new
        tensor; reads the head only."""
        rows, vocab = x.shape[0], self.weight.shape[0]
        screened = self.ops.linear_panels(x, self.screen, None, vocab).numpy()
        keep = self.candidates(screened, x)
        tokens = np.unique(np.concatenate(keep)) if rows else np.zeros(0, np.int64)
        out = np.full((rows, vocab), -np.inf, dtype=np.float32)
        if tokens.size:
            index = torch.from_numpy(tokens)
            panels = self.ops.pack_panels(self.weight.index_select(0, index))
            exact = self.ops.linear_panels(x, panels, None, int(tokens.size))  # [R, T]
            out[:, tokens] = exact.numpy()
        return torch.from_numpy(out)
