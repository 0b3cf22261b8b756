"""Content-addressed chunk keys.

A chunk's key is a chained hash ``H(parent_key || token_ids)`` whose root is the digest of
the namespace (model identity, dtype, layout, chunk size, tenant salt). Equal keys therefore
mean "same tokens after the same prefix, for the same model and format". A hash can still
collide, so every tier keeps the token ids beside the chunk and compares them on a hit.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvtier.kv.layout import KVLayout

ChunkKey = bytes
"""A chunk key: ``KeyHasher.digest_bytes`` raw bytes (16 by default)."""


@dataclass(frozen=True)
class Namespace:
    """Everything that must match for KV to be reusable.

    Attributes:
        model_id: identity of the weights (a path, a name plus revision, or a digest).
        layout: the chunked KV layout (dtype, shapes, chunk size).
        tenant_salt: isolates tenants that must never share KV; empty means shared.
    """

    model_id: str
    layout: KVLayout
    tenant_salt: str = ""

    def __post_init__(self) -> None:
        if not self.model_id:
            raise ValueError("model_id: must be a non-empty string naming the weights")

    def describe(self) -> str:
        return f"kvtier/v1|{self.model_id}|{self.layout.fingerprint()}|{self.tenant_salt}"


class KeyHasher:
    """Computes chained chunk keys within one namespace.

    Thread-safe (stateless after construction).

    Args:
        namespace: the namespace every key is derived from.
        digest_bytes: key length, 1..64. Short digests exist only to force collisions
            in tests; keep the default in production.
    """

    def __init__(self, namespace: Namespace, digest_bytes: int = 16) -> None:
        if not 1 <= digest_bytes <= 64:
            raise ValueError(f"digest_bytes: must be in 1..64, got {digest_bytes}")
        self.namespace = namespace
        self.digest_bytes = digest_bytes
        self.root: ChunkKey = self._hash(namespace.describe().encode())

    @property
    def chunk_tokens(self) -> int:
        return self.namespace.layout.chunk_tokens

    def root_for(self, salt: str = "") -> ChunkKey:
        """The root key of a tenant's chains: the namespace's, or one derived from it and
        the request's ``salt`` (so no two salts ever share a key)."""
        if not salt:
            return self.root
        return self._hash(self.root, b"|salt|", salt.encode("utf-8", "surrogatepass"))

    def _hash(self, *parts: bytes) -> ChunkKey:
        h = hashlib.blake2b(digest_size=self.digest_bytes)
        for part in parts:
            h.update(part)
        return h.digest()

    def key(
        self, parent: ChunkKey | None, token_ids: Sequence[int] | np.ndarray, salt: str = ""
    ) -> ChunkKey:
        """The key of a chunk holding ``token_ids`` after the chunk keyed ``parent``.

        ``parent=None`` means the chunk starts the sequence (under ``salt``'s root).
        """
        ids = np.asarray(token_ids, dtype=np.int64)
        return self._hash(self.root_for(salt) if parent is None else parent, ids.tobytes())

    def partial_key(
        self, parent: ChunkKey | None, token_ids: Sequence[int] | np.ndarray, salt: str = ""
    ) -> ChunkKey:
        """The key of a *partial* chunk: the first ``len(token_ids)`` (< chunk_tokens) tokens
        after the chunk keyed ``parent``, stored in a whole chunk's buffer. Never equal to
        a full chunk's key (a marker is hashed in)."""
        ids = np.asarray(token_ids, dtype=np.int64)
        base = self.root_for(salt) if parent is None else parent
        return self._hash(base, b"|partial|", ids.tobytes())

    def chain(self, token_ids: Sequence[int] | np.ndarray, salt: str = "") -> list[ChunkKey]:
        """Keys of every *full* chunk of ``token_ids`` (a trailing partial chunk has none),
        chained from ``salt``'s root."""
        ids = np.asarray(token_ids, dtype=np.int64)
        keys: list[ChunkKey] = []
        parent = self.root_for(salt)
        for start in range(0, len(ids) - self.chunk_tokens + 1, self.chunk_tokens):
            parent = self._hash(parent, ids[start : start + self.chunk_tokens].tobytes())
            keys.append(parent)
        return keys
