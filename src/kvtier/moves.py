"""How bytes move between the manager's tiers: evict hooks and host⇄disk link steps.

``kvtier.manager.KVManager`` keeps the books (where every chunk is, what is being written,
the counters); the callables here move the bytes, run by a tier's eviction (the hooks) or
on the host⇄disk link's worker thread (the steps). Each names the manager whose state it
updates; none raises to its caller: a disk that takes no writes, or whose slots are all
pinned, just does not take the chunk (counted by the tier).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from kvtier.kv.chunk import Chunk, ChunkRef
from kvtier.tiers.base import Tier, TierFullError
from kvtier.tiers.disk_io import copy_bytes
from kvtier.transfer import CopyStep

if TYPE_CHECKING:
    from kvtier.manager import KVManager

log = logging.getLogger(__name__)


class WriteDown:
    """Evict hook: write a victim to the next tier down unless it already holds it."""

    def __init__(self, lower: Tier) -> None:
        self.lower = lower

    def __call__(self, victim: Chunk) -> None:
        if not self.lower.contains(victim.ref):
            self.lower.put([victim])


class DiskWriteDown:
    """Host evict hook: send a victim disk lacks to disk, off the compute thread if it can.

    Runs under the host lock, in whichever thread's ``put`` evicted. The victim is copied
    into a spare chunk (a memory copy) and written on the host⇄disk link; with no spare
    free or no room on the link it is written here (so write-back never loses a chunk).
    Never raises: a disk that takes no writes skips it (the tier counts it).
    """

    def __init__(self, manager: KVManager) -> None:
        self.manager = manager

    def __call__(self, victim: Chunk) -> None:
        manager, disk, link = self.manager, self.manager.disk, self.manager.host_disk_link
        assert disk is not None and link is not None
        if manager._on_disk(victim.ref):
            return
        if disk.writes_disabled:
            disk.put([victim])  # skips it, counted in the disk's writes_skipped
            return
        spare = manager._take_spare()
        if spare is not None:
            copy_bytes(spare, victim.data)
            step = SpareWrite(manager, victim.ref, spare)
            with manager._lock:
                manager._writing[victim.key] = victim.ref
            handle = link.try_submit([CopyStep(manager.layout.chunk_nbytes, range(0), step)], 0)
            if handle is not None:
                manager._track(handle)
                manager._count_write_down(asynchronous=True)
                return
            with manager._lock:
                del manager._writing[victim.key]
            manager._give_spare(spare)
        put_quietly(disk, Chunk(victim.ref, victim.data))
        manager._count_write_down(asynchronous=False)


def put_quietly(disk: Tier, chunk: Chunk) -> None:
    """``disk.put([chunk])`` where no caller can take an error: a disk whose every slot is
    pinned just does not take it (I/O errors never leave a degrading tier)."""
    try:
        disk.put([chunk])
    except TierFullError as exc:
        log.debug("disk: chunk %s not written: %s", chunk.ref.short(), exc)


class SpareWrite:
    """Link step: write an evicted chunk held in a spare buffer to disk, then free it."""

    def __init__(self, manager: KVManager, ref: ChunkRef, spare: torch.Tensor) -> None:
        self.manager = manager
        self.ref = ref
        self.spare = spare

    def __call__(self) -> None:
        manager = self.manager
        try:
            assert manager.disk is not None
            put_quietly(manager.disk, Chunk(self.ref, self.spare))
        finally:
            with manager._lock:
                manager._writing.pop(self.ref.key, None)
            manager._give_spare(self.spare)


class DiskWrite:
    """Link step: copy one host chunk to disk, pinned while it is read (write-through)."""

    def __init__(self, manager: KVManager, ref: ChunkRef) -> None:
        self.manager = manager
        self.ref = ref

    def __call__(self) -> None:
        host, disk = self.manager.host, self.manager.disk
        if disk is None or disk.contains(self.ref) or not host.pin([self.ref])[0]:
            return  # landed already, or evicted (and written down on the way out)
        try:
            view = host.view(self.ref)  # type: ignore[attr-defined]
            if view is not None:
                put_quietly(disk, Chunk(self.ref, view))
        finally:
            host.unpin([self.ref])


class Promote:
    """Link step: copy one chunk from disk into host; records the outcome if asked."""

    def __init__(
        self,
        manager: KVManager,
        ref: ChunkRef,
        outcomes: list[str] | None = None,
        index: int = 0,
    ) -> None:
        self.manager = manager
        self.ref = ref
        self.outcomes = outcomes
        self.index = index

    def __call__(self) -> None:
        outcome = self._promote()
        if self.outcomes is not None:
            self.outcomes[self.index] = outcome

    def _promote(self) -> str:
        manager = self.manager
        if manager.host.contains(self.ref):
            return "host"
        if manager.disk is None:
            return "missing"
        if manager._staging is None:
            manager._staging = manager.layout.empty_chunk().zero_()
        staging = manager._staging
        held = manager._on_disk(self.ref)
        if not manager.disk.get_into([self.ref], [staging])[0]:
            if not held:
                return "missing"
            manager.count_recompute("corrupt")  # counted where found, whoever asked
            return "corrupt"
        try:
            manager.host.put([Chunk(self.ref, staging)])
        except TierFullError:  # every host slot pinned: the caller recomputes it
            return "missing"
        return "host"
