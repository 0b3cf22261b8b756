"""The fp8 codec: e4m3 codes with one fp32 scale per (layer, k/v, head) block.

fp8's exponent keeps relative precision over the whole range, so one scale per block (the
block's largest magnitude mapped to e4m3's largest finite value, 448) suffices. Encoded
layout, flat ``uint8``::

    scale fp32 [L, 2, H, 1, 1] | codes float8_e4m3fn [L, 2, H, T, D]

On float32 CPU chunks both directions run ``codec_ops.cpp``'s kernels (``fp8_encode``,
``fp8_decode``: the same bytes and bits as the torch path below).
"""

from __future__ import annotations

import torch

from kvtier.codec.base import Codec, check_shapes, native_ops, sections
from kvtier.kv.layout import KVLayout

_E4M3_MAX = 448.0
_MIN_SCALE = 1e-12  # an all-zero block still divides by something finite


class Fp8Codec(Codec):
    """e4m3 codes, per-block scale. Thread-safe (stateless)."""

    name = "fp8"

    @staticmethod
    def _parts(shape: tuple[int, ...]) -> list[tuple[torch.dtype, tuple[int, ...]]]:
        n_layers, two, heads, tokens, dim = shape
        return [
            (torch.float32, (n_layers, two, heads, 1, 1)),
            (torch.float8_e4m3fn, (n_layers, two, heads, tokens, dim)),
        ]

    def encoded_nbytes(self, layout: KVLayout) -> int:
        n_layers, two, heads, tokens, dim = layout.chunk_shape
        return n_layers * two * heads * (4 + tokens * dim)

    def encode_into(self, chunk: torch.Tensor, out: torch.Tensor) -> None:
        check_shapes(self, chunk, out)
        scale, codes = sections(out, self._parts(tuple(chunk.shape)))
        ops = native_ops(chunk)
        if ops is not None:
            ops.fp8_encode(chunk, scale, codes)
            return
        x = chunk.to(torch.float32)
        torch.amax(x.abs(), dim=(3, 4), keepdim=True, out=scale)
        scale.div_(_E4M3_MAX).clamp_(min=_MIN_SCALE)
        codes.copy_((x / scale).clamp_(-_E4M3_MAX, _E4M3_MAX))

    def decode_into(self, encoded: torch.Tensor, out: torch.Tensor) -> None:
        check_shapes(self, out, encoded)
        scale, codes = sections(encoded, self._parts(tuple(out.shape)))
        ops = native_ops(out)
        if ops is not None:
            ops.fp8_decode(scale, codes, out)
            return
        out.copy_(codes.to(torch.float32).mul_(scale))
