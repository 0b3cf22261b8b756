"""Chunk codecs: the byte format a tier stores chunks in (``raw``, ``fp8``, ``int8``,
``int4``), chosen per tier (``HostConfig.codec`` and the lower tiers' configs' ``codec``).

The registry is a module constant, filled at import and read-only afterwards.
"""

from __future__ import annotations

from kvtier.codec.base import Codec, RawCodec
from kvtier.codec.fp8 import Fp8Codec
from kvtier.codec.quant import Int4Codec, Int8Codec, KiviCodec

__all__ = ["CODECS", "Codec", "Fp8Codec", "Int4Codec", "Int8Codec", "KiviCodec", "RawCodec"]
__all__ += ["get_codec"]

CODECS: dict[str, Codec] = {c.name: c for c in (RawCodec(), Fp8Codec(), Int8Codec(), Int4Codec())}


def get_codec(name: str) -> Codec:
    """The codec registered as ``name``; ``ValueError`` naming the accepted ones if none."""
    codec = CODECS.get(name)
    if codec is None:
        raise ValueError(f"codec: unknown {name!r}; accepted: {list(CODECS)}")
    return codec
