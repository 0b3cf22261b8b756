"""The on-disk format of the disk tier: file names, slot header layout, checksums.

One directory per tier; segment ``k`` of a layout is the file
``{fingerprint}.s{segment_slots}.{k:05d}.kvseg``, which holds the slots
``k * segment_slots ...`` back to back, each ``slot_nbytes`` long; ``{fingerprint}.lock``
is the layout's lock file. A slot is a header block followed by the chunk's bytes, each
padded to ``ALIGN``::

    slot = [header block: header_nbytes, a multiple of 4096][chunk bytes, padded to 4096]

The header (little-endian, see ``_FIXED``) holds a magic, its own xxh3_64 checksum, the
format version, a sequence number (monotonic per directory), the slot's own index, the
chunk's byte length and xxh3_64, the layout fingerprint, the key and the token ids (int64).
An all-zero header block marks a free slot. Everything here is pure (no I/O, no shared
state) and thread-safe.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import xxhash

from kvtier.codec import Codec, RawCodec
from kvtier.kv.chunk import ChunkRef
from kvtier.kv.layout import KVLayout
from kvtier.tiers.disk_io import round_up

MAGIC = b"KVTSLOT\x00"
FORMAT_VERSION = 1
MAX_KEY_NBYTES = 64
# magic, header checksum, version, header_nbytes, seq, slot, data_nbytes, data_hash,
# num_tokens, key length, fingerprint length, key, fingerprint; the token ids follow.
_FIXED = struct.Struct("<8sQIIQQQQIHH64s128s")
_CHECKSUMMED_FROM = 16  # the checksum covers the header block after magic and checksum


class SlotHeader(NamedTuple):
    """The fields of a decoded header that the tier uses."""

    seq: int
    slot: int
    key: bytes
    token_bytes: bytes  # int64 little-endian
    data_hash: int

    def ref(self) -> ChunkRef:
        """The chunk this header names (key and token ids)."""
        token_ids = tuple(np.frombuffer(self.token_bytes, dtype="<i8").tolist())
        return ChunkRef(self.key, token_ids)


def segment_name(fingerprint: bytes, segment_slots: int, segment: int) -> str:
    """The file name of segment ``segment`` of a layout, ``segment_slots`` slots per file."""
    return f"{fingerprint.decode()}.s{segment_slots}.{segment:05d}.kvseg"


def lock_name(fingerprint: bytes) -> str:
    """The file name of a layout's lock file."""
    return f"{fingerprint.decode()}.lock"


def find_segments(names: Iterable[str], fingerprint: bytes) -> dict[int, list[int]]:
    """The segment numbers of a layout among file ``names``, by slots per file."""
    pattern = re.compile(re.escape(fingerprint.decode()) + r"\.s(\d+)\.(\d+)\.kvseg")
    found: dict[int, list[int]] = {}
    for name in names:
        match = pattern.fullmatch(name)
        if match:
            found.setdefault(int(match[1]), []).append(int(match[2]))
    return found


def data_hasher() -> xxhash.xxh3_64:
    """A fresh streaming hash of chunk bytes, as stored in ``SlotHeader.data_hash``."""
    return xxhash.xxh3_64()


@dataclass(frozen=True)
class SlotFormat:
    """The slot geometry and header codec of one KV layout.

    Args:
        fingerprint: the layout fingerprint, stored in and checked against every header.
        data_nbytes: the chunk's byte length.
        header_nbytes: the header block's length (a multiple of ``ALIGN``).
    """

    fingerprint: bytes
    data_nbytes: int
    header_nbytes: int

    @classmethod
    def for_layout(cls, layout: KVLayout, codec: Codec | None = None) -> SlotFormat:
        """The format of ``layout``'s chunks stored with ``codec`` (default ``raw``): room in
        the header for ``chunk_tokens`` token ids; the fingerprint names the codec
        (``Codec.fingerprint``), so segments of another codec are other files and their
        headers fail ``decode``."""
        codec = codec or RawCodec()
        header_nbytes = round_up(_FIXED.size + 8 * layout.chunk_tokens)
        fingerprint = codec.fingerprint(layout).encode()
        return cls(fingerprint, codec.encoded_nbytes(layout), header_nbytes)

    @property
    def slot_nbytes(self) -> int:
        return self.header_nbytes + round_up(self.data_nbytes)

    @property
    def max_tokens(self) -> int:
        """The most token ids a header has room for."""
        return (self.header_nbytes - _FIXED.size) // 8

    def fits(self, key: bytes, token_bytes: bytes) -> bool:
        """True if a header has room for this key and these token ids."""
        return len(key) <= MAX_KEY_NBYTES and _FIXED.size + len(token_bytes) <= self.header_nbytes

    def encode(
        self, buf: memoryview, seq: int, slot: int, key: bytes, token_bytes: bytes, data_hash: int
    ) -> None:
        """Write a whole header block (checksummed) into ``buf[:header_nbytes]``.

        The caller checks ``fits(key, token_bytes)`` first.
        """
        head = self.header_nbytes
        buf[:head] = bytes(head)
        _FIXED.pack_into(
            buf, 0, MAGIC, 0, FORMAT_VERSION, head, seq, slot, self.data_nbytes, data_hash,
            len(token_bytes) // 8, len(key), len(self.fingerprint), key, self.fingerprint,
        )  # fmt: skip
        buf[_FIXED.size : _FIXED.size + len(token_bytes)] = token_bytes
        struct.pack_into("<Q", buf, 8, xxhash.xxh3_64_intdigest(buf[_CHECKSUMMED_FROM:head]))

    def decode(self, block: memoryview) -> SlotHeader | None:
        """The header in ``block`` if whole, intact and of this format; else None."""
        if len(block) != self.header_nbytes or bytes(block[:8]) != MAGIC:
            return None
        (_, checksum, version, head, seq, slot, data_nbytes, data_hash, num_tokens, key_len,
         fp_len, key, fingerprint) = _FIXED.unpack_from(block)  # fmt: skip
        tokens_end = _FIXED.size + 8 * num_tokens
        if (
            checksum != xxhash.xxh3_64_intdigest(block[_CHECKSUMMED_FROM:])
            or version != FORMAT_VERSION
            or head != self.header_nbytes
            or data_nbytes != self.data_nbytes
            or fingerprint[:fp_len] != self.fingerprint
            or key_len > MAX_KEY_NBYTES
            or tokens_end > head
        ):
            return None
        return SlotHeader(
            seq, slot, key[:key_len], bytes(block[_FIXED.size : tokens_end]), data_hash
        )
