"""Exact low-bit codes of a float32 weight, and the code panels ``linear_panels`` reads.

A weight dequantised from a GGUF file has few distinct values: the embedded SmolLM2 is Q4_1
in every projection and Q8_0 in its tied embedding and head. Per output and block of 32
inputs such a weight is ``w = d * u + m`` with ``u`` an unsigned code: 4 bits (Q4_1: ``d``
and ``m`` the block's float16 scale and minimum) or 8 bits (Q8_0: ``u = q + 128`` and
``m = -128 d``, so ``d * u + m = d * q`` exactly). ``find_codes`` recovers ``d``, ``m`` and
``u`` from the float32 values and keeps them only where every weight is rebuilt from them
bit for bit (``d * u`` exact in float32, so the sum has one rounding, the same with or
without an FMA). ``linear_panels`` then widens each weight to that very float32 value and
multiplies in the float32 panels' order, so its products are bit for bit the float32
panels' (tested): the same tokens from 5 bits a weight (4-bit codes, plus ``d`` and ``m`` in
float16 per 32 weights) instead of 32.

kvtier's bf16 mode multiplies the same codes on bf16 code panels (``pack_code_panels(...,
bf16=True)``): x rounded to bf16, times the exact weight, on vdpbf16ps, where the bf16
panels would read a weight rounded to bf16 at 16 bits a weight.

Any other weight (trained in float32, or a quantisation of another form) finds no codes in
its first rows and keeps its float32 panels; a NaN or an infinity never matches.

Both functions only read their input; the tensors they return are new and owned by the
caller.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

ENV_SWITCH = "KVTIER_WEIGHT_CODES"
"""``KVTIER_WEIGHT_CODES=0`` keeps every weight's float32 panels (for comparison)."""

CODE_K = 32
"""Inputs per block: one ``d`` and ``m`` per output and block (GGUF's block size)."""
PANEL = 16
"""Outputs per panel (``linear_panels``' vector width)."""
TILE_PANELS = 3
"""Panels per group: the kernel's work item, one stream of bytes."""
_PROBE_ROWS = 64
"""Rows tried first: a weight without codes is turned away after them."""
_SLICE_ROWS = 4096
"""Rows checked at a time (bounds the float32 temporaries of a large head)."""


@dataclass(frozen=True)
class WeightCodes:
    """A weight ``[O, I]`` as ``w[o, 32 b + j] = scale[o, b] * codes[o, 32 b + j] +
    offset[o, b]``, exact in float32.

    Attributes:
        bits: 4 or 8, the codes' width.
        scale: ``[O, B]`` float32, ``B = ceil(I / 32)``; every value a float16 one.
        offset: ``[O, B]`` float32; every value a float16 one.
        codes: ``[O, 32 B]`` uint8 below ``2 ** bits`` (zero past ``I``).
    """

    bits: int
    scale: torch.Tensor
    offset: torch.Tensor
    codes: torch.Tensor


_FORMS = ((4, False), (8, True), (8, False))
"""(bits, symmetric) tried in order: Q4_1's form, Q8_0's, then 8 bits with a minimum."""


def weight_codes_on() -> bool:
    """Whether projections look for codes (``KVTIER_WEIGHT_CODES`` is not ``0``)."""
    return os.environ.get(ENV_SWITCH, "1") != "0"


def find_codes(weight: torch.Tensor) -> WeightCodes | None:
    """``weight``'s exact codes (the first form of ``_FORMS`` that rebuilds every value),
    or None: not a float32 CPU matrix, or no form rebuilds it."""
    if weight.dtype != torch.float32 or weight.dim() != 2 or weight.device.type != "cpu":
        return None
    weight = weight.detach()
    for bits, symmetric in _FORMS:
        if _codes(weight[:_PROBE_ROWS], bits, symmetric) is None:
            continue
        parts = [
            _codes(weight[start : start + _SLICE_ROWS], bits, symmetric)
            for start in range(0, weight.shape[0], _SLICE_ROWS)
        ]
        if any(part is None for part in parts):
            continue
        found = [part for part in parts if part is not None]
        return WeightCodes(
            bits=bits,
            scale=torch.cat([p[0] for p in found]),
            offset=torch.cat([p[1] for p in found]),
            codes=torch.cat([p[2] for p in found]),
        )
    return None


def _codes(
    weight: torch.Tensor, bits: int, symmetric: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(scale, offset, codes) of ``weight`` in one form, or None where any value is not
    rebuilt exactly or the offset is no float16. The scale is taken as GGUF's quantisers set
    it, rounded to float16 (the format stores it so); the check, not the guess, decides."""
    rows, cols = weight.shape
    blocks = -(-cols // CODE_K)
    pad = blocks * CODE_K - cols
    if pad:  # the last block padded with its last value: the same minimum and maximum
        weight = torch.cat([weight, weight[:, -1:].expand(rows, pad)], dim=1)
    w = weight.reshape(rows, blocks, CODE_K)
    lo, hi = w.amin(-1), w.amax(-1)
    top = (1 << bits) - 1
    if symmetric:
        scale = (torch.maximum(hi.abs(), lo.abs()) / (top // 2)).half().float()
        offset = -(top // 2 + 1) * scale
    else:
        scale = ((hi - lo) / top).half().float()
        offset = lo
    divisor = torch.where(scale == 0, torch.ones_like(scale), scale)
    codes = torch.round((w - offset[..., None]) / divisor[..., None]).clamp_(0, top)
    # d * u is exact: a float16 d has 11 significant bits and u at most 8, and no float16
    # times 255 leaves float32's normal range; so only the sum's one rounding is checked.
    # (== also passes -0 for +0: a zero weight's sign never changes a sum that starts at +0.)
    if not bool((scale[..., None] * codes + offset[..., None] == w).all()):
        return None
    if not bool((offset.half().float() == offset).all()):  # the panels hold float16
        return None
    codes_u8 = codes.to(torch.uint8).reshape(rows, blocks * CODE_K)
    if pad:
        codes_u8[:, cols:] = 0
    return scale, offset, codes_u8


def pack_code_panels(codes: WeightCodes, bf16: bool = False) -> torch.Tensor:
    """The code panels of ``codes``: uint8 ``[G, B, 3, 64 + 64 bits]`` (``linear_ops.cpp``
    has the layout): ``G = ceil(ceil(O / 16) / 3)`` groups of 3 panels of 16 outputs (zero
    outputs pad the last), per block of 32 inputs each panel's ``d[16]``, ``m[16]`` (float16)
    and codes (4 bits: 16 pairs of inputs a byte per output, the even input low; 8 bits: 32
    lines of 16 bytes).

    With ``bf16``: the bf16 code panels ``linear_panels`` multiplies with x rounded to bf16,
    ``[G, B, 3, 1 + bits, 64]`` in lines of 64 bytes, each code line 8 inputs of the 16
    outputs' 4-bit codes in the order ``linear_ops.cpp``'s two byte unpacks turn into
    vdpbf16ps pairs (8 bits: the low nibbles' 4 lines, then the high nibbles')."""
    out_features, blocks = codes.scale.shape
    group = TILE_PANELS * PANEL
    groups = -(-out_features // group)
    rows = groups * group

    def padded(t: torch.Tensor) -> torch.Tensor:
        full = torch.zeros((rows, *t.shape[1:]), dtype=t.dtype)
        full[:out_features] = t
        return full

    def lanes(t: torch.Tensor) -> torch.Tensor:  # [rows, B] -> [G, B, 3, 32] float16 bytes
        t = padded(t.half()).view(groups, TILE_PANELS, PANEL, blocks).permute(0, 3, 1, 2)
        return t.contiguous().view(torch.uint8)

    u = padded(codes.codes).view(groups, TILE_PANELS, PANEL, blocks, CODE_K)
    if bf16:
        # 8 bits: the low nibbles' lines, then the high nibbles' (the same order each)
        planes = [u] if codes.bits == 4 else [u & 15, u >> 4]
        body = torch.cat([_unpack_order(plane) for plane in planes], dim=-1)
    else:
        if codes.bits == 4:
            u = u[..., 0::2] | (u[..., 1::2] << 4)  # [G, 3, 16, B, 16 pairs]
        body = u.permute(0, 3, 1, 4, 2).reshape(groups, blocks, TILE_PANELS, -1)
    panels = torch.cat([lanes(codes.scale), lanes(codes.offset), body], dim=-1)
    return panels.view(groups, blocks, TILE_PANELS, -1, 64) if bf16 else panels


def _unpack_order(u: torch.Tensor) -> torch.Tensor:
    """4-bit codes ``[G, 3, 16, B, 32]`` as the bf16 code lines ``[G, B, 3, 256]``: output
    ``4 q + w`` at input ``8 t + 4 h + 2 g + p`` goes to line ``t``, byte ``16 q + 8 g + 2 w +
    p``, the high nibble where ``h`` is 1."""
    groups, panels, _, blocks, _ = u.shape
    u = u.reshape(groups, panels, 4, 4, blocks, CODE_K // 8, 2, 2, 2)
    u = u.permute(0, 4, 1, 5, 2, 7, 3, 8, 6)  # [G, B, 3, t, q, g, w, p, h]
    return (u[..., 0] | (u[..., 1] << 4)).reshape(groups, blocks, panels, -1)
