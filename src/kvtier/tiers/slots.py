"""What a tier stores its chunks in: the slot storage every ``Tier`` subclass provides.

``kvtier.tiers.base.Tier`` keeps the index, token-id checks, pins, eviction and stats
identically for every tier; a subclass says only how a slot is allocated, written, read
and freed (host memory, a segment file, a Redis value). Which calls happen under the
tier's lock is stated per method.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from kvtier.kv.chunk import Chunk, ChunkRef


class SlotStorage(ABC):
    """The slot hooks ``Tier`` calls (see the module docstring)."""

    @abstractmethod
    def _alloc_slot(self) -> int | None:
        """A free slot index, or None when all are taken. Called under the lock."""

    @abstractmethod
    def _free_slot(self, slot: int) -> None:
        """Return a slot to the free list. Called under the lock."""

    @abstractmethod
    def _write_slot(self, slot: int, chunk: Chunk) -> None:
        """Copy ``chunk`` into a reserved slot. Called without the lock."""

    @abstractmethod
    def _read_slot(self, slot: int, ref: ChunkRef, out: torch.Tensor) -> bool:
        """Copy a pinned slot into ``out``; False if the stored bytes are found corrupt.

        Called without the lock.
        """

    @abstractmethod
    def _victim_data(self, slot: int) -> torch.Tensor | None:
        """The data of a slot about to be evicted, readable during the evict hook.

        None if the stored bytes are found corrupt: the victim is then dropped without the
        hook and counted in ``stats.corrupt_dropped``. Called under the lock, and only
        when an evict hook is installed.
        """

    def _forget_slot(self, slot: int) -> None:
        """Hook for durable tiers to mark a slot invalid before it is reused."""
        return None

    def _end_put(self) -> None:
        """Hook run once at the end of every ``put`` call, also when it raises.

        Called without the lock, in the thread that called ``put``; durable tiers flush the
        writes of the call here. An exception raised here propagates out of ``put``.
        """
        return None
