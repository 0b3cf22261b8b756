"""Memory tiers: a pre-allocated, pre-faulted pool of chunk-sized slots.

The same class backs the device tier (GPU memory on CUDA, a RAM budget on a CPU-only
machine) and the host tier (DRAM, pinned when CUDA is available). The pool is allocated
once and touched at start, because first touch of fresh memory is far slower than a copy
into touched memory (0.41 vs 5 GB/s measured here, DESIGN §8).

A host pool may store its chunks compressed (``codec``, ``HostConfig.codec``): each slot is
then the chunk's layers encoded one after another, ``[L, layer_stored_nbytes]`` of
``uint8``, so the staging ring decodes one layer of a chunk on the link's worker
(``layer_into``) and only the encoded bytes cross the link. Such a pool cannot be read in
place as float32: ``slot_data`` refuses, ``view`` returns a decoded copy.
"""

from __future__ import annotations

import dataclasses
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
        codec: registry name of the codec slots are stored in (``raw``: the chunk's own
            dtype, readable in place; any other: encoded layer by layer, slot-major only).
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
        codec: str = "raw",
    ) -> None:
        super().__init__(name, layout, capacity_bytes, eviction_policy, codec)
        self.device = torch.device(device)
        self.layer_major = layer_major
        self.coded = not self.codec.exact
        num_layers, two, heads, tokens, dim = layout.chunk_shape
        self.layer_stored_nbytes = self.stored_chunk_nbytes // num_layers
        shape: tuple[int, ...]
        dtype = torch.uint8 if self.coded else layout.dtype
        if self.coded:
            if layer_major or storage is not None:
                raise ValueError(f"{name}: a {self.codec.name} pool is slot-major and its own")
            one_layer = dataclasses.replace(layout, num_layers=1)
            if self.codec.encoded_nbytes(one_layer) != self.layer_stored_nbytes:
                raise ValueError(f"{name}: codec {self.codec.name} does not split by layer")
            shape = (self.num_slots, num_layers, self.layer_stored_nbytes)
        elif layer_major:
            shape = (num_layers, two, heads, self.num_slots, tokens, dim)
        else:
            shape = (self.num_slots, num_layers, two, heads, tokens, dim)
        if storage is not None:
            if (
                tuple(storage.shape) != shape
                or storage.dtype != dtype
                or storage.device != self.device
            ):
                raise ValueError(
                    f"{name}: storage {tuple(storage.shape)} {storage.dtype} on "
                    f"{storage.device} is not the pool's {shape} {dtype} on {self.device}"
                )
            self.pool = storage
        else:
            self.pool = torch.empty(shape, dtype=dtype, device=self.device, pin_memory=pin_memory)
            self.pool.zero_()  # pre-fault every page now, not on the first put
        self._free: list[int] = list(range(self.num_slots))  # a min-heap

    def _alloc_slot(self) -> int | None:
        # The lowest free slot: chunks put into an emptied tier lie end to end from slot 0,
        # so the device tier's attention reads them as one unmasked range.
        return heapq.heappop(self._free) if self._free else None

    def _free_slot(self, slot: int) -> None:
        heapq.heappush(self._free, slot)

    def slot_data(self, slot: int) -> torch.Tensor:
        """Slot ``slot`` as a chunk-shaped view ``[L, 2, H, T, D]`` (strided if layer-major).

        Raises:
            ValueError: the pool is coded (its slots are not float32 to read in place).
        """
        if self.coded:
            raise ValueError(
                f"{self.name}: a {self.codec.name} pool holds encoded bytes; it cannot be "
                "read in place (use layer_into or view)"
            )
        return self.pool[:, :, :, slot] if self.layer_major else self.pool[slot]

    def layer_into(self, slot: int, layer_idx: int, out: torch.Tensor) -> None:
        """Copy (raw) or decode (coded) layer ``layer_idx`` of slot ``slot`` into ``out``
        (``[2, H, T, D]``, the layout's dtype, any strides with the last one 1, any device).

        Writes ``out`` only. The caller holds a pin on the chunk; thread-safe otherwise (a
        link worker calls it). A CUDA ``out`` of a raw pool is filled without a sync.
        """
        cuda = out.device.type == "cuda"
        if not self.coded:
            out.copy_(self.slot_data(slot)[layer_idx], non_blocking=cuda)
            return
        encoded = self.pool[slot, layer_idx]
        if encoded.device != out.device:
            encoded = encoded.to(out.device, non_blocking=cuda)
        self.codec.decode_into(encoded, out.unsqueeze(0))

    def _write_slot(self, slot: int, chunk: Chunk) -> None:
        cuda = self.device.type == "cuda" or chunk.data.device.type == "cuda"
        if self.coded:
            data, target = chunk.data, self.pool[slot]
            here = data.device == target.device  # else encode where the data is, move bytes
            encoded = target if here else torch.empty_like(target, device=data.device)
            for layer in range(self.layout.num_layers):
                self.codec.encode_into(data[layer : layer + 1], encoded[layer])
            if not here:
                target.copy_(encoded)
        else:
            self.slot_data(slot).copy_(chunk.data, non_blocking=self.device.type == "cuda")
        if cuda:
            torch.cuda.current_stream().synchronize()

    def _read_slot(self, slot: int, ref: ChunkRef, out: torch.Tensor) -> bool:
        if self.coded:
            self._decode_slot(slot, out)
        else:
            out.copy_(self.slot_data(slot))
        return True

    def _decode_slot(self, slot: int, out: torch.Tensor) -> torch.Tensor:
        """Decode every layer of coded slot ``slot`` into ``out`` (chunk-shaped); returns it."""
        for layer in range(self.layout.num_layers):
            self.layer_into(slot, layer, out[layer])
        return out

    def _decoded(self, slot: int) -> torch.Tensor:
        """A new chunk-shaped tensor holding coded slot ``slot`` decoded (the caller owns it)."""
        out = torch.empty(self.layout.chunk_shape, dtype=self.layout.dtype)
        return self._decode_slot(slot, out)

    def _victim_data(self, slot: int) -> torch.Tensor:
        return self._decoded(slot) if self.coded else self.slot_data(slot)

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
        """The slot of a held chunk, without a copy (a coded pool: decoded into a new
        tensor); None if not held.

        The view is valid only while the caller holds a pin on the chunk (``pin``/``unpin``);
        it must not be written to.
        """
        with self._lock:
            entry = self._index.match(ref)
            if entry is None:
                return None
            self._index.policy.touch(ref.key)
            slot = entry.slot
            if not self.coded:
                return self.slot_data(slot)
        return self._decoded(slot)  # outside the lock: the caller's pin holds the slot


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
    codec: str = "raw",
) -> PoolTier:
    """The host tier: a DRAM pool, page-locked when CUDA is available (unless told), its
    chunks stored in ``codec``."""
    if pin_memory is None:
        pin_memory = torch.cuda.is_available()
    return PoolTier(
        "host",
        layout,
        capacity_bytes,
        "cpu",
        pin_memory=pin_memory,
        eviction_policy=eviction_policy,
        codec=codec,
    )
