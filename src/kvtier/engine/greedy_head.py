"""The LM head for rows that only need their most likely token: the same argmax as the
float32 head, reading a quarter of its bytes.

A greedy row with no log-probabilities needs one thing of its logits: the first index of
their maximum. ``GreedyHead`` screens the whole vocabulary with an int8 copy of the head
(per-token scale; ``linear_panels`` on int8 panels, each line widened to float32 as read),
bounds how far each screened logit can be from the float32 one, and computes exactly, with
the head's own kernel (float32 ``linear_panels``), only the tokens the bound cannot rule
out: on SmolLM2-135M's own decode steps 1 token in the median step, 7 at the 90th
percentile, at most 367 of 49,152 (576 steps). There the head is 113 MB of the 538 MB a
batch-1 step reads and the screen 28 MB; per-step alternation in one engine (2-core AMD
EPYC, Zen 4, 2026-12-07): one row 20.6 / 21.0 / 20.6 → 18.9 / 18.7 / 18.6 ms, four rows
19.3 / 19.1 → 18.3 / 18.2 ms, but eight rows 22.8–23.7 → 23.2–24.1 and sixteen 42.6–47.4 →
43.7–48.1 (the screen's widening costs more than its bytes save once the rows share the
weights), hence ``ROWS_MAX``. A bf16 head (the bf16 mode) gained nothing from it (one
row 9.32 / 9.11 / 9.30 ms with it against 9.35 / 9.15 / 9.35 without), so it has none; a
bf16 screen of the float32 head saved about half what int8 does (one row 19.8 / 20.0 /
19.4 against 21.1 / 20.8 / 20.5 ms).

The bound, for a row ``x`` (float32), a vocabulary row ``w`` and its screen ``ŵ`` (int8
times the token's scale, as real numbers), with ``γ = H u / (1 − H u)``, ``u = 2^-24``:

- the head's logit ``L`` is within ``γ ||x|| ||w||`` of the real ``x·w`` (float32 sums of
  ``H`` fused products, in any order);
- the screen's ``A`` is within ``(γ + 2u) ||x|| ||ŵ||`` of the real ``x·ŵ`` (fused
  products of exact integers, then one product with the scale), which is within
  ``||x|| ||ŵ − w||`` of ``x·w``;

so ``|A − L| <= D = ||x|| (E + (γ + 2u) P + γ W)`` with the per-token norms ``W = ||w||``,
``P = ||ŵ||``, ``E = ||ŵ − w||`` (float64, once at start), inflated for the float64
arithmetic that evaluates it. A token ``j`` with ``A_j + D_j < max_i (A_i − D_i)`` then has
``L_j < L_m`` for the token ``m`` that attains that maximum: it is neither the maximum nor
tied with it. Every other token's logit is computed by the head's kernel on the same row,
whose per-output arithmetic does not depend on which outputs a call holds (each is one
chain of FMAs over ``k`` in one lane), so its bits are the head's and the first maximum is
the same token.

``logits`` returns ``[R, V]`` with those exact logits and ``-inf`` elsewhere: the argmax
is the head's; nothing else of the row is (the runner asks only for rows sampled greedily
without log-probabilities).

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

_INT8_MAX = 127
"""The screen's integers: ``[-127, 127]``, a token's scale its largest ``|w|`` / 127."""

ROWS_MAX = 4
"""Most rows a call screens (measured above); more take the whole head."""

_NORM_ROWS = 4096
"""Vocabulary rows widened to float64 at a time while the norms are computed."""

_SLACK_REL = 1e-3
"""``D`` inflated by this fraction: covers evaluating it (and comparing) in float64."""

_SLACK_ABS = 1e-30
"""And this much absolute, for a row whose norm is 0 (the bound is then 0 too)."""


@dataclass(frozen=True)
class GreedyHead:
    """A float32 head ``weight [V, H]`` with its int8 screen.

    Attributes:
        weight: the model's head (shared, read-only): the candidates' rows.
        screen: int8 panels ``[P, H, 16]``; ``scales [V]`` float32 each token's scale.
        bound: ``[V]`` float64 each token's ``D / ||x||`` (``E + (γ + 2u) P + γ W``);
            ``bound_max`` its largest.
        ops: kvtier's CPU kernels (``pack_panels``, ``linear_panels``).
    """

    weight: torch.Tensor
    screen: torch.Tensor
    scales: torch.Tensor
    bound: np.ndarray
    bound_max: float
    ops: Any

    @staticmethod
    def why_not(weight: torch.Tensor) -> str | None:
        """Why ``weight`` cannot be screened; None when it can."""
        if weight.dtype != torch.float32 or weight.dim() != 2 or not weight.is_cpu:
            return "the head is not a float32 CPU [V, H]"
        if not bool(torch.isfinite(weight).all()):
            return "the head holds a NaN or an infinity (no bound holds)"
        return None

    @classmethod
    def build(cls, weight: torch.Tensor, ops: Any) -> GreedyHead:
        """The screen of ``weight [V, H]`` (28 MB for SmolLM2-135M's 113 MB head). ``ops``:
        kvtier's CPU kernels. Raises ValueError where ``why_not``."""
        reason = cls.why_not(weight)
        if reason is not None:
            raise ValueError(f"GreedyHead: {reason}")
        weight = weight.detach().contiguous()
        vocab, hidden = weight.shape
        peak = weight.abs().amax(dim=1)
        scales = peak / _INT8_MAX  # float32; 0 for a zero row
        divisor = torch.where(peak > 0, scales, torch.ones_like(scales))
        quant = torch.round(weight / divisor[:, None]).clamp_(-_INT8_MAX, _INT8_MAX)
        quant = quant.to(torch.int8)
        norms = np.empty((3, vocab), dtype=np.float64)
        for start in range(0, vocab, _NORM_ROWS):  # float64 a slice at a time
            part = slice(start, start + _NORM_ROWS)
            v = weight[part].double()
            w_hat = quant[part].double() * scales[part].double()[:, None]
            stop = start + v.shape[0]
            norms[0, start:stop] = v.norm(dim=1).numpy()
            norms[1, start:stop] = w_hat.norm(dim=1).numpy()
            norms[2, start:stop] = (w_hat - v).norm(dim=1).numpy()
        gamma = hidden * _UNIT_ROUNDOFF / (1 - hidden * _UNIT_ROUNDOFF)
        bound = norms[2] + (gamma + 2 * _UNIT_ROUNDOFF) * norms[1] + gamma * norms[0]
        return cls(
            weight=weight,
            screen=ops.pack_panels(quant),
            scales=scales.contiguous(),
            bound=bound,
            bound_max=float(bound.max()),
            ops=ops,
        )

    def candidates(self, screened: np.ndarray, x: torch.Tensor) -> list[np.ndarray]:
        """Per row of ``x [R, H]``, the tokens whose float32 logit may be the row's maximum,
        given the screen's logits ``screened [R, V]`` (float32); sorted token ids."""
        norm_x = x.double().norm(dim=1).numpy()
        out = []
        for r in range(screened.shape[0]):
            row = screened[r]
            top = float(row.max())
            if not (math.isfinite(top) and math.isfinite(norm_x[r])):  # no bound holds
                out.append(np.arange(row.shape[0]))
                continue
            # every token's D is at most d_max: a first cut with one bound for the row
            d_max = norm_x[r] * self.bound_max * (1 + _SLACK_REL) + _SLACK_ABS
            cut = top - 2 * d_max - 1e-12 * abs(top)
            cut32 = np.float32(cut)
            if cut32 > cut:  # rounded up: one float32 lower, so the cut keeps no fewer
                cut32 = np.nextafter(cut32, np.float32(-np.inf))
            near = np.flatnonzero(row >= cut32)
            logit = row[near].astype(np.float64)
            d = norm_x[r] * self.bound[near] * (1 + _SLACK_REL) + (
                _SLACK_ABS + 1e-12 * np.abs(logit)
            )
            floor = float((logit - d).max())  # at most max_i (A_i - D_i) over all tokens
            out.append(near[logit + d >= floor])
        return out

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """``[R, V]`` float32 for ``x [R, H]`` (contiguous float32): the head's logit at
        every token that may be its row's first maximum, ``-inf`` elsewhere. A new tensor;
        reads the head only."""
        rows, vocab = x.shape[0], self.weight.shape[0]
        screened = self.ops.linear_panels(x, self.screen, None, vocab, self.scales).numpy()
        keep = self.candidates(screened, x)
        tokens = np.unique(np.concatenate(keep)) if rows else np.zeros(0, np.int64)
        out = np.full((rows, vocab), -np.inf, dtype=np.float32)
        if tokens.size:
            panels = self.ops.pack_panels(self.weight.index_select(0, torch.from_numpy(tokens)))
            exact = self.ops.linear_panels(x, panels, None, int(tokens.size))  # [R, T]
            out[:, tokens] = exact.numpy()
        return torch.from_numpy(out)
