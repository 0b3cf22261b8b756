"""Memory tiers: a pre-allocated, pre-faulted pool of chunk-sized slots.

The same class backs the device tier (GPU memory on CUDA, a RAM budget on a CPU-only
machine) and the host tier (DRAM, pinned when CUDA is available). The pool is allocated
once and touched at start, because first touch of fresh memory is far slower than a copy
into touched memory (0.41 vs 5 GB/s measured here, DESIGN §8).
"""

from __future__ import annotations

import heapq

import torch

from kvtier.kv.chunk import Chunk, ChunkRef
from kvtier.kv.layout import KVLayout
from kvtier.tiers.base import Tier


class PoolTier(Tier):
    """A tier whose slots live in one pre-allocated tensor.

    Slot-major pools (``[num_slots, L, 2, H, T, D]``, the host) keep each chunk contiguous for
    whole-chunk I/O. Layer-major pools (``[L, 2, H, num_slots, T, D]``, the device) lay the
    slots of one layer and head end to end along the token axis, so attention reads one
    layer of a run of resident chunks as one ``[H, S*T, D]`` sequence (``layer_kv``), with no
    gather and one kernel call.

    Args:
        name: tier name ("device" or "host").
        layout: chunk layout.
        capacity_bytes: byte budget; the pool holds ``capacity_bytes // chunk_nbytes`` slots.
        device: where the pool lives.
        pin_memory: page-lock a CPU pool (fast, async copies to CUDA).
        eviction_policy: registry name of the eviction policy.
        layer_major: lay the pool out ``[L, 2, H, S, T, D]`` instead of ``[S, L, 2, H, T, D]``.
        storage: a tensor of exactly the pool's shape, dtype and device to hold the slots
            (the caller owns it and has touched it; ``kvtier.runtime.seats``); None
            allocates and touches one.
    """

    def __init__(
        self,
        name: str,
        layout: KVLayout,
        capacity_bytes: int,
        device: torch.device | str = "cpu",
        pin_memory: bool = False,
        eviction_policy: str = "lru",
        layer_major: bool = False,
        storage: torch.Tensor | None = None,
    ) -> None:
        super().__init__(name, layout, capacity_bytes, eviction_policy)
        self.device = torch.device(device)
        self.layer_major = layer_major
        num_layers, two, heads, tokens, dim = layout.chunk_shape
        shape = (
            (num_layers, two, heads, self.num_slots, tokens, dim)
            if layer_major
            else (self.num_slots, num_layers, two, heads, tokens, dim)
        )
        if storage is not None:
            if (
                tuple(storage.shape) != shape
                or storage.dtype != layout.dtype
                or storage.device != self.device
            ):
                raise ValueError(
                    f"{name}: storage {tuple(storage.shape)} {storage.dtype} on "
                    f"{storage.device} is not the pool's {shape} {layout.dtype} on {self.device}"
                )
            self.pool = storage
        else:
            self.pool = torch.empty(
                shape, dtype=layout.dtype, device=self.device, pin_memory=pin_memory
            )
            self.pool.zero_()  # pre-fault every page now, not on the first put
        self._free: list[int] = list(range(self.num_slots))  # a min-heap

    def _alloc_slot(self) -> int | None:
        # The lowest free slot: chunks put into an emptied tier lie end to end from slot 0,
        # so the device tier's attention reads them as one unmasked range.
        return heapq.heappop(self._free) if self._free else None

    def _free_slot(self, slot: int) -> None:
        heapq.heappush(self._free, slot)

    def slot_data(self, slot: int) -> torch.Tensor:
        """Slot ``slot`` as a chunk-shaped view ``[L, 2, H, T, D]`` (strided if layer-major)."""
        return self.pool[:, :, :, slot] if self.layer_major else self.pool[slot]

    def _write_slot(self, slot: int, chunk: Chunk) -> None:
        self.slot_data(slot).copy_(chunk.data, non_blocking=self.device.type == "cuda")
        if self.device.type == "cuda" or chunk.data.device.type == "cuda":
            torch.cuda.current_stream().synchronize()

    def _read_slot(self, slot: int, ref: ChunkRef, out: torch.Tensor) -> bool:
        out.copy_(self.slot_data(slot))
        return True

    def _victim_data(self, slot: int) -> torch.Tensor:
        return self.slot_data(slot)

    def slot_of(self, ref: ChunkRef) -> int | None:
        """The slot index of a held chunk (None if not held); stable while it is pinned."""
        with self._lock:
            entry = self._index.match(ref)
            return None if entry is None else entry.slot

    def layer_kv(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of one layer for every slot, ``[H, S, T, D]`` each (layer-major).

        ``keys[:, a:b].reshape(H, -1, D)`` is slots ``a..b-1`` as one sequence, without a copy.
        Views into the pool: valid for the slots the caller has pinned.
        """
        if not self.layer_major:
            raise ValueError(f"{self.name}: layer_kv needs a layer-major pool")
        return self.pool[layer_idx, 0], self.pool[layer_idx, 1]

    def view(self, ref: ChunkRef) -> torch.Tensor | None:
        """The slot of a held chunk, without a copy; None if not held.

        The view is valid only while the caller holds a pin on the chunk (``pin``/``unpin``);
        it must not be written to.
        """
        with self._lock:
            entry = self._index.match(ref)
            if entry is None:
                return None
            self._index.policy.touch(ref.key)
            return self.slot_data(entry.slot)


def device_tier(
    layout: KVLayout,
    budget_bytes: int,
    device: torch.device | str | None = None,
    eviction_policy: str = "lru",
    storage: torch.Tensor | None = None,
) -> PoolTier:
    """The device tier: GPU memory on CUDA, otherwise a RAM budget on the CPU.

    Layer-major, so that attention reads one layer of every resident chunk in one piece.
    ``storage``: the slots' tensor when the caller holds it (a seat of a slab).
    """
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return PoolTier(
        "device",
        layout,
        budget_bytes,
        device,
        eviction_policy=eviction_policy,
        layer_major=True,
        storage=storage,
    )


def host_tier(
    layout: KVLayout,
    capacity_bytes: int,
    pin_memory: bool | None = None,
    eviction_policy: str = "lru",
) -> PoolTier:
    """The host tier: a DRAM pool, page-locked when CUDA is available (unless told)."""
    if pin_memory is None:
        pin_memory = torch.cuda.is_available()
    return PoolTier(
        "host",
        layout,
        capacity_bytes,
        "cpu",
        pin_memory=pin_memory,
        eviction_policy=eviction_policy,
    )
