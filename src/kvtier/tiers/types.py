"""The public types every tier shares: its errors, its counters and what a ``put`` did.

Pure data (no tier state, no I/O); ``TierStats`` and ``PutResult`` are plain values the
tier hands out as copies, so the caller owns them and may keep or change them freely.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field, fields

import torch

from kvtier.kv.chunk import Chunk, ChunkRef
from kvtier.kv.keys import ChunkKey


class TierFullError(RuntimeError):
    """Raised by ``put`` when no slot can be freed because every chunk is pinned."""


class ChunkLostError(RuntimeError):
    """A sequence's own sealed chunk is in no tier any more (evicted, corrupt, unreadable).

    Raised mid-sequence by the cache that needs the chunk, before the forward pass uses
    any KV: the sequence's state is intact up to its sealed chunks, and it can resume by
    recomputing from its longest prefix still cached (``TieredCache.reuse_prefix``).

    Attributes:
        cause: ``"corrupt"`` (the chunk's stored bytes failed their checks) or
            ``"missing"`` (evicted or never landed).
        num_chunks: how many of the sequence's chunks are lost.
    """

    def __init__(self, message: str, cause: str = "missing", num_chunks: int = 1) -> None:
        super().__init__(message)
        self.cause = cause
        self.num_chunks = num_chunks


@dataclass
class TierStats:
    """Counters of one tier. Read them through ``Tier.stats()`` (a consistent copy).

    ``corrupt_dropped`` counts chunks dropped because their stored bytes failed a check
    (or could not be read); ``io_errors`` counts failed I/O calls; ``writes_disabled`` is 1
    while a tier refuses writes after an I/O error (0 otherwise; a sum over tiers counts
    the disabled ones); ``writes_skipped`` counts chunks not stored because of it (or, in
    the shared tier, because the store was down); ``writes_dropped`` counts chunks a full
    write-behind queue dropped (the oldest first).
    """

    hits: int = 0
    misses: int = 0
    puts: int = 0
    duplicate_puts: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    evictions: int = 0
    collisions: int = 0
    corrupt_dropped: int = 0
    io_errors: int = 0
    writes_disabled: int = 0  # 1 while the tier refuses writes after an I/O error
    writes_skipped: int = 0  # chunks not written because writes were disabled (or down)
    writes_dropped: int = 0  # write-behind chunks dropped: its queue was full (oldest first)
    put_seconds: float = 0.0
    get_seconds: float = 0.0

    def as_dict(self) -> dict[str, float]:
        return dict(asdict(self))

    @classmethod
    def total(cls, items: Iterable[TierStats]) -> TierStats:
        """Field-wise sum: one figure for several tiers of one kind (e.g. the device tiers
        of every running sequence)."""
        out = cls()
        for item in items:
            for f in fields(cls):
                setattr(out, f.name, getattr(out, f.name) + getattr(item, f.name))
        return out

    @property
    def put_gbps(self) -> float:
        return self.bytes_in / self.put_seconds / 1e9 if self.put_seconds else 0.0

    @property
    def get_gbps(self) -> float:
        return self.bytes_out / self.get_seconds / 1e9 if self.get_seconds else 0.0


@dataclass(frozen=True)
class PutResult:
    """What a ``put`` did: keys newly stored, keys already present, chunks evicted."""

    stored: list[ChunkKey] = field(default_factory=list)
    already_present: list[ChunkKey] = field(default_factory=list)
    evicted: list[ChunkRef] = field(default_factory=list)


EvictHook = Callable[[Chunk], None]
"""Called with a victim (its data readable for the duration of the call) before its slot
is freed; the manager uses it to write back to the next tier. Runs under the tier lock."""

ChunkReader = Callable[[ChunkRef, torch.Tensor], bool]
"""Copies a chunk's bytes into a caller-owned buffer from wherever it is held; False (the
buffer untouched or partly written) when it is held nowhere the reader looks. Thread-safe;
blocks for the copy."""
