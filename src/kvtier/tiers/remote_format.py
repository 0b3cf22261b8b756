"""The shared tier's keys and values (``kvtier.tiers.remote``): pure, thread-safe.

Key: ``{prefix}:{layout digest}:{chunk key}`` (hex). The chunk key already digests the
model, the layout and the tenant salt (``kvtier.kv.keys``), so two models, layouts or
tenants never share a key; the layout digest keeps one layout's chunks apart for
operators, and the prefix lets an ACL user be limited to ``~{prefix}:*``.

Value: a header, then the chunk's stored bytes (``Codec.encoded_nbytes``: the chunk's own
bytes with the ``raw`` codec)::

    magic "KVTREDIS" | version u32 | header bytes u32 | layout digest (16) | layers u32 |
    tokens u32 | data bytes u64 | key length u16 | key | token ids (int64 each) |
    checksum u64: xxh3_64 over the header before it and over the data

A value is served only when all of it matches what the reader expects (format, layout,
key, token ids, length and checksum): a corrupt, truncated or foreign value reads as None.
The layout digest covers the chunk codec (``Codec.fingerprint``; every function takes the
codec, default ``raw``), so keys and headers of one codec never match a reader of another:
such a chunk is a miss, never decoded as the wrong codec.
"""

from __future__ import annotations

import struct

import numpy as np
import xxhash

from kvtier.codec import Codec, RawCodec
from kvtier.kv.chunk import ChunkRef
from kvtier.kv.layout import KVLayout

MAGIC = b"KVTREDIS"
FORMAT_VERSION = 1
_FIXED = struct.Struct("<8sII16sIIQH")
_CHECKSUM = struct.Struct("<Q")


_RAW = RawCodec()


def layout_digest(layout: KVLayout, codec: Codec = _RAW) -> bytes:
    """16 bytes naming the layout and the codec (``Codec.fingerprint``)."""
    return xxhash.xxh3_128_digest(codec.fingerprint(layout).encode())


def chunk_key(prefix: str, layout: KVLayout, ref: ChunkRef, codec: Codec = _RAW) -> str:
    """The Redis key of ``ref``'s chunk."""
    return f"{prefix}:{layout_digest(layout, codec).hex()}:{ref.key.hex()}"


def encode(layout: KVLayout, ref: ChunkRef, data: memoryview, codec: Codec = _RAW) -> bytes:
    """The value of ``ref``'s chunk, whose stored (``codec``-encoded) bytes are ``data``."""
    tokens = np.asarray(ref.token_ids, dtype="<i8").tobytes()
    head_nbytes = _FIXED.size + len(ref.key) + len(tokens)
    header = _FIXED.pack(
        MAGIC, FORMAT_VERSION, head_nbytes, layout_digest(layout, codec), layout.num_layers,
        len(ref.token_ids), len(data), len(ref.key),
    ) + ref.key + tokens  # fmt: skip
    hasher = xxhash.xxh3_64(header)
    hasher.update(data)
    return b"".join((header, data, _CHECKSUM.pack(hasher.intdigest())))


MAX_KEY_NBYTES = 64  # a chunk key is a blake2b digest (kvtier.kv.keys)


def max_value_nbytes(layout: KVLayout, codec: Codec = _RAW) -> int:
    """The length of the longest intact value of ``layout``: a whole chunk's, with the
    longest key."""
    data_nbytes = codec.encoded_nbytes(layout)
    return _FIXED.size + MAX_KEY_NBYTES + 8 * layout.chunk_tokens + data_nbytes + 8


def value_nbytes(layout: KVLayout, ref: ChunkRef, codec: Codec = _RAW) -> int:
    """The length of an intact value of ``ref``'s chunk."""
    return header_nbytes(ref) + codec.encoded_nbytes(layout) + _CHECKSUM.size


def decode(
    layout: KVLayout, ref: ChunkRef, value: bytes | memoryview, codec: Codec = _RAW
) -> tuple[str, memoryview | None]:
    """What ``value`` holds for a read of ``ref``'s chunk of ``layout``: ``("ok", data)``;
    ``("other", None)``: an intact value of another chunk under this key (a collision);
    ``("corrupt", None)``: anything else (damaged, truncated, another format or codec).
    ``data`` is the stored bytes, still ``codec``-encoded."""
    corrupt = ("corrupt", None)
    view = memoryview(value)
    if len(view) < _FIXED.size + _CHECKSUM.size or bytes(view[:8]) != MAGIC:
        return corrupt
    _, version, head_nbytes, digest, layers, num_tokens, data_nbytes, key_len = _FIXED.unpack_from(
        view
    )
    if (
        version != FORMAT_VERSION
        or digest != layout_digest(layout, codec)
        or layers != layout.num_layers
        or data_nbytes != codec.encoded_nbytes(layout)
        or head_nbytes != _FIXED.size + key_len + 8 * num_tokens
        or len(view) != head_nbytes + data_nbytes + _CHECKSUM.size
    ):
        return corrupt
    data = view[head_nbytes : head_nbytes + data_nbytes]
    hasher = xxhash.xxh3_64(view[:head_nbytes])
    hasher.update(data)
    (checksum,) = _CHECKSUM.unpack_from(view, head_nbytes + data_nbytes)
    if checksum != hasher.intdigest():
        return corrupt
    key = bytes(view[_FIXED.size : _FIXED.size + key_len])
    tokens = np.frombuffer(view[_FIXED.size + key_len : head_nbytes], dtype="<i8")
    if key != ref.key or tuple(tokens.tolist()) != tuple(ref.token_ids):
        return ("other", None)
    return ("ok", data)


def layout_pattern(prefix: str, layout: KVLayout, codec: Codec = _RAW) -> str:
    """A ``SCAN`` pattern matching every chunk key of ``layout`` and ``codec`` under
    ``prefix``."""
    return f"{prefix}:{layout_digest(layout, codec).hex()}:*"


def header_nbytes(ref: ChunkRef) -> int:
    """The length of the header of ``ref``'s value."""
    return _FIXED.size + len(ref.key) + 8 * len(ref.token_ids)


def names(layout: KVLayout, ref: ChunkRef, head: bytes, codec: Codec = _RAW) -> bool:
    """True if ``head`` (a value's first ``header_nbytes(ref)`` bytes) is the header of
    ``ref``'s chunk of ``layout``: format, layout, key and token ids (the checksum needs
    the whole value: ``decode``)."""
    view = memoryview(head)
    if len(view) != header_nbytes(ref) or bytes(view[:8]) != MAGIC:
        return False
    _, version, head_nbytes, digest, layers, num_tokens, data_nbytes, key_len = _FIXED.unpack_from(
        view
    )
    tokens = np.frombuffer(view[_FIXED.size + key_len : head_nbytes], dtype="<i8")
    return bool(
        version == FORMAT_VERSION
        and digest == layout_digest(layout, codec)
        and layers == layout.num_layers
        and data_nbytes == codec.encoded_nbytes(layout)
        and head_nbytes == len(view)
        and num_tokens == len(ref.token_ids)
        and key_len == len(ref.key)
        and bytes(view[_FIXED.size : _FIXED.size + key_len]) == ref.key
        and tuple(tokens.tolist()) == tuple(ref.token_ids)
    )
