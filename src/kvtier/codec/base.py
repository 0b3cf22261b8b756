"""The chunk codec interface: how a tier turns a chunk into the bytes it stores, and back.

A codec maps one chunk ``[L, 2 (k, v), H, T, D]`` of a ``KVLayout`` to a fixed number of
bytes (``encoded_nbytes``) and back. ``raw`` keeps the chunk's own bytes (exact); the others
quantise (``fp8``, ``int8``, ``int4``) and change tokens by a measured amount
(``kvtier bench codec``). Every encoded buffer is one flat ``uint8`` tensor: the per-group
parameters (scales, offsets) first, then the quantised data, so every section starts at a
byte offset its element type can be viewed at.

Codecs are stateless, so one instance serves every thread at once. On the CPU, with float32
chunks whose last stride is 1, the lossy codecs run kvtier's native kernels
(``kvtier.native``, ``codec_ops.cpp``: single-threaded, on the caller's thread, bit-identical
to the torch path in both directions, so a chunk written by either reads the same in
either); elsewhere (a GPU, half precision, ``KVTIER_NATIVE=0``, no compiler) torch's ops.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

import torch

from kvtier import native
from kvtier.kv.layout import KVLayout


class Codec(ABC):
    """Encodes chunks of any ``KVLayout`` into ``encoded_nbytes(layout)`` bytes.

    Thread-safe (no state). Neither call keeps a reference to its arguments.
    """

    name: ClassVar[str] = ""
    exact: ClassVar[bool] = False
    """True when ``decode(encode(x)) == x`` bit for bit (only ``raw``)."""

    @abstractmethod
    def encoded_nbytes(self, layout: KVLayout) -> int:
        """Bytes of one encoded chunk of ``layout`` (fixed: every chunk has this size)."""

    @abstractmethod
    def encode_into(self, chunk: torch.Tensor, out: torch.Tensor) -> None:
        """Encode ``chunk`` (``[L, 2, H, T, D]``, the layout's dtype, any strides, on the
        CPU or a GPU) into ``out`` (flat ``uint8``, ``encoded_nbytes`` long, same device).

        Reads ``chunk``; writes all of ``out``.
        """

    @abstractmethod
    def decode_into(self, encoded: torch.Tensor, out: torch.Tensor) -> None:
        """Decode ``encoded`` (flat ``uint8``, ``encoded_nbytes`` long) into ``out``
        (``[L, 2, H, T, D]``, the layout's dtype, any strides, same device).

        Reads ``encoded``; writes all of ``out``.
        """

    def encode(self, chunk: torch.Tensor, layout: KVLayout) -> torch.Tensor:
        """``encode_into`` a new ``uint8`` buffer, which the caller owns."""
        out = torch.empty(self.encoded_nbytes(layout), dtype=torch.uint8, device=chunk.device)
        self.encode_into(chunk, out)
        return out

    def fingerprint(self, layout: KVLayout) -> str:
        """The stored format's name: the layout's fingerprint, then the codec's name (none
        for ``raw``, so chunks stored before codecs existed still read). Tiers write it into
        every header and compare it on read, so a chunk stored with one codec is never read
        as another."""
        base = layout.fingerprint()
        return base if self.exact else f"{base}.{self.name}"

    def ratio(self, layout: KVLayout) -> float:
        """Encoded bytes over the chunk's own bytes (1.0 for ``raw``)."""
        return self.encoded_nbytes(layout) / layout.chunk_nbytes


def check_shapes(codec: Codec, chunk: torch.Tensor, encoded: torch.Tensor) -> None:
    """Raise ``ValueError`` unless ``encoded`` is a flat ``uint8`` buffer on the chunk's
    device (``encoded_nbytes`` is checked by the section views)."""
    if encoded.dtype != torch.uint8 or encoded.dim() != 1:
        raise ValueError(
            f"{codec.name}: the encoded buffer must be flat uint8, got "
            f"{tuple(encoded.shape)} {encoded.dtype}"
        )
    if encoded.device != chunk.device:
        raise ValueError(
            f"{codec.name}: chunk on {chunk.device} but encoded buffer on {encoded.device}"
        )


def native_ops(chunk: torch.Tensor) -> Any | None:
    """``kvtier.native.ops()`` when its codec kernels take ``chunk`` (a float32 CPU chunk
    whose last stride is 1), else None: the caller takes its torch path."""
    if chunk.dtype != torch.float32 or not chunk.is_cpu or chunk.stride(-1) != 1:
        return None
    return native.ops()


def sections(
    encoded: torch.Tensor, parts: list[tuple[torch.dtype, tuple[int, ...]]]
) -> list[torch.Tensor]:
    """Views of consecutive sections of ``encoded`` (flat ``uint8``): one per ``(dtype,
    shape)``, in order; the sections must fill ``encoded`` exactly."""
    views: list[torch.Tensor] = []
    offset = 0
    for dtype, shape in parts:
        itemsize = dtype.itemsize
        numel = 1
        for size in shape:
            numel *= size
        nbytes = numel * itemsize
        views.append(encoded[offset : offset + nbytes].view(dtype).view(shape))
        offset += nbytes
    if offset != encoded.numel():
        raise ValueError(f"encoded buffer holds {encoded.numel()} bytes, the codec needs {offset}")
    return views


class RawCodec(Codec):
    """The chunk's own bytes: exact, and the default wherever exactness is promised."""

    name = "raw"
    exact = True

    def encoded_nbytes(self, layout: KVLayout) -> int:
        return layout.chunk_nbytes

    def encode_into(self, chunk: torch.Tensor, out: torch.Tensor) -> None:
        check_shapes(self, chunk, out)
        out.view(chunk.dtype).view(chunk.shape).copy_(chunk)

    def decode_into(self, encoded: torch.Tensor, out: torch.Tensor) -> None:
        check_shapes(self, out, encoded)
        out.copy_(encoded.view(out.dtype).view(out.shape))
