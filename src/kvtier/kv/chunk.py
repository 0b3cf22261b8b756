"""The chunk handle that moves between tiers."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from kvtier.kv.keys import ChunkKey, KeyHasher


@dataclass(frozen=True)
class ChunkRef:
    """Names one sealed chunk: its key and the token ids it holds.

    The token ids travel with the key so that every tier can compare them on a hit: a
    key collision then reads as a miss, never as wrong KV. ``parent`` is the key of the
    chunk before this one in its sequence (None for a first chunk, or where it is not
    known, e.g. a chunk read back from disk); eviction uses it to keep prefixes whole
    (``kvtier.policy.prefix``). It is a hint: refs compare and hash by key and token ids.
    """

    key: ChunkKey
    token_ids: tuple[int, ...]
    parent: ChunkKey | None = field(default=None, compare=False, repr=False)

    @classmethod
    def of(cls, key: ChunkKey, token_ids: object, parent: ChunkKey | None = None) -> ChunkRef:
        ids = tuple(int(t) for t in np.asarray(token_ids, dtype=np.int64).ravel())
        return cls(key, ids, parent)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def token_bytes(self) -> bytes:
        """Token ids as little-endian int64 bytes (the on-disk and on-wire form)."""
        return np.asarray(self.token_ids, dtype="<i8").tobytes()

    def short(self) -> str:
        return self.key.hex()[:12]


@dataclass(frozen=True)
class Chunk:
    """A sealed chunk: its reference plus a buffer ``[L, 2, H, T, D]``.

    ``data`` is a view owned by whoever created the handle (a tier slot, a staging buffer);
    a tier's ``put`` copies from it and never keeps it.
    """

    ref: ChunkRef
    data: torch.Tensor

    @property
    def key(self) -> ChunkKey:
        return self.ref.key


def chunk_refs(
    hasher: KeyHasher, token_ids: Sequence[int] | np.ndarray, salt: str = ""
) -> list[ChunkRef]:
    """References of every full chunk of ``token_ids`` (a partial tail has none), keyed
    under the tenant ``salt`` (empty: the shared namespace). Pure."""
    ids = np.asarray(token_ids, dtype=np.int64)
    size = hasher.chunk_tokens
    keys = hasher.chain(ids, salt)
    return [
        ChunkRef.of(key, ids[i * size : (i + 1) * size], keys[i - 1] if i else None)
        for i, key in enumerate(keys)
    ]
