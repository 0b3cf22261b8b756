"""Integer codecs after KIVI: keys per channel, values per token, 8 or 4 bits.

Keys have outlier channels (a few head dimensions much larger than the rest), so a key's
scale and offset are per channel over the chunk's tokens; values vary per token, so theirs
are per token over the head dimension. Both are asymmetric (min and step), grouped per
(layer, k/v, head). Encoded layout, flat ``uint8``::

    key_min   fp32 [L, H, 1, D] | value_min   fp32 [L, H, T, 1]
    key_step  fp16 [L, H, 1, D] | value_step  fp16 [L, H, T, 1]
    codes     uint8 [L, 2, H, T, D] (8 bits), or two codes a byte (4 bits: low nibble first)

Offsets stay fp32 (a channel with a large mean and a small spread keeps its precision);
steps are fp16, and the codes are computed with the rounded step, so rounding it costs
nothing but a clamp at the top of the range. Ratio to fp32 for ``T`` tokens of head size
``D``: ``bits/32 + 0.75 (1/T + 1/D)`` (int8, T=256, D=64: 0.265).

On float32 CPU chunks both directions run ``codec_ops.cpp``'s kernels (``kivi_encode``,
``kivi_decode``), which do the torch path's float operations in its order, so the stored
bytes and the decoded bits are the same either way (``tests/codec/test_native_codecs.py``).
"""

from __future__ import annotations

from typing import Any

import torch

from kvtier.codec.base import Codec, check_shapes, native_ops, sections
from kvtier.kv.layout import KVLayout

_MIN_STEP = 1e-6  # a constant group still gets a finite, non-zero step in fp16
_FP16_MAX = 65504.0


class KiviCodec(Codec):
    """``bits``-bit integer codes (8 or 4) with KIVI's grouping. Thread-safe (stateless)."""

    def __init__(self, bits: int) -> None:
        if bits not in (4, 8):
            raise ValueError(f"bits: 4 or 8, got {bits}")
        self.bits = bits
        self.levels = (1 << bits) - 1

    def _parts(self, layout: KVLayout) -> list[tuple[torch.dtype, tuple[int, ...]]]:
        n_layers, _, heads, tokens, dim = layout.chunk_shape
        codes = n_layers * 2 * heads * tokens * dim * self.bits // 8
        return [
            (torch.float32, (n_layers, heads, 1, dim)),
            (torch.float32, (n_layers, heads, tokens, 1)),
            (torch.float16, (n_layers, heads, 1, dim)),
            (torch.float16, (n_layers, heads, tokens, 1)),
            (torch.uint8, (codes,)),
        ]

    def encoded_nbytes(self, layout: KVLayout) -> int:
        total = 0
        for dtype, shape in self._parts(layout):
            numel = 1
            for size in shape:
                numel *= size
            total += numel * dtype.itemsize
        return total

    def _layout_of(self, chunk: torch.Tensor) -> KVLayout:
        n_layers, two, heads, tokens, dim = chunk.shape
        if two != 2:
            raise ValueError(f"{self.name}: a chunk is [L, 2, H, T, D], got {tuple(chunk.shape)}")
        return KVLayout(n_layers, heads, dim, chunk.dtype, tokens)

    def _native(self, chunk: torch.Tensor) -> Any | None:
        """The native kernels when they take ``chunk`` (int4 packs pairs along D: even D)."""
        if self.bits == 4 and chunk.shape[-1] % 2:
            return None
        return native_ops(chunk)

    def encode_into(self, chunk: torch.Tensor, out: torch.Tensor) -> None:
        check_shapes(self, chunk, out)
        k_min, v_min, k_step, v_step, codes = sections(out, self._parts(self._layout_of(chunk)))
        ops = self._native(chunk)
        if ops is not None:
            ops.kivi_encode(chunk, k_min, v_min, k_step, v_step, codes, self.bits)
            return
        x = chunk.to(torch.float32)
        for x_part, lo, step, dim in ((x[:, 0], k_min, k_step, 2), (x[:, 1], v_min, v_step, 3)):
            torch.amin(x_part, dim=dim, keepdim=True, out=lo)
            lo.clamp_(-_FP16_MAX, _FP16_MAX).add_(0.0)  # a zero min stored as +0, not -0
            spread = torch.amax(x_part, dim=dim, keepdim=True).sub_(lo)
            step.copy_(spread.div_(self.levels).clamp_(_MIN_STEP, _FP16_MAX))
        q = torch.empty(chunk.shape, dtype=torch.float32, device=chunk.device)
        torch.sub(x[:, 0], k_min, out=q[:, 0]).div_(k_step.float())
        torch.sub(x[:, 1], v_min, out=q[:, 1]).div_(v_step.float())
        q8 = q.round_().clamp_(0, self.levels).to(torch.uint8).view(-1)
        if self.bits == 8:
            codes.copy_(q8)
        else:
            pairs = q8.view(-1, 2)
            torch.bitwise_or(pairs[:, 0], pairs[:, 1] << 4, out=codes)

    def decode_into(self, encoded: torch.Tensor, out: torch.Tensor) -> None:
        check_shapes(self, out, encoded)
        k_min, v_min, k_step, v_step, codes = sections(encoded, self._parts(self._layout_of(out)))
        ops = self._native(out)
        if ops is not None:
            ops.kivi_decode(k_min, v_min, k_step, v_step, codes, self.bits, out)
            return
        if self.bits == 8:
            q = codes.to(torch.float32)
        else:
            q = torch.stack((codes & 15, codes >> 4), dim=1).to(torch.float32)
        q = q.view(out.shape)  # min + code * step: two roundings, as the native kernel's
        q[:, 0].mul_(k_step.float()).add_(k_min)
        q[:, 1].mul_(v_step.float()).add_(v_min)
        out.copy_(q)


class Int8Codec(KiviCodec):
    """8-bit KIVI codes: a quarter of fp32's bytes plus the scales."""

    name = "int8"

    def __init__(self) -> None:
        super().__init__(8)


class Int4Codec(KiviCodec):
    """4-bit KIVI codes: an eighth of fp32's bytes plus the scales."""

    name = "int4"

    def __init__(self) -> None:
        super().__init__(4)
