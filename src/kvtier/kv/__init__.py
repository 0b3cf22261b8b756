"""KV layout, chunk keys and the chunk handle that moves between tiers."""

from __future__ import annotations

from kvtier.kv.chunk import Chunk, ChunkRef
from kvtier.kv.keys import ChunkKey, KeyHasher, Namespace
from kvtier.kv.layout import KVLayout

__all__ = ["Chunk", "ChunkKey", "ChunkRef", "KVLayout", "KeyHasher", "Namespace"]
