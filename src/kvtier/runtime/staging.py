"""Streaming non-resident chunks from the host pool into a device staging ring.

A forward pass needs, for every layer, the layer slice of every sealed chunk that is not
resident on the device. Those slices are cut into *pieces* (one layer, up to
``piece_chunks`` chunks) and copied over the device⇄host link into a ring of staging slots
on the device, ``lookahead`` pieces ahead of the layer being computed. A piece's slot is
reused as soon as its attention has been computed (``release``), so device memory for
streaming is a fixed allowance, ``ring_slots × piece_chunks × layer_nbytes``, whatever the
context length. A coded host pool (``HostConfig.codec``) sends its encoded bytes, decoded
into the ring on the link's worker.

Thread-safety: a ``StagingRing`` is driven by the one thread running the forward pass; the
copies run on the link's worker.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvtier.config import LinkConfig
from kvtier.kv.layout import KVLayout
from kvtier.tiers.pool import PoolTier
from kvtier.transfer import CopyStep, Link, LinkStats, Throttle, TransferHandle


@dataclass(frozen=True)
class Piece:
    """One layer's slices of up to ``piece_chunks`` host-resident chunks.

    Attributes:
        layer_idx: the layer.
        host_slots: slot of each chunk in the host pool (pinned for the forward pass).
        rows: batch row that owns each chunk.
        chunk_idx: index of each chunk within its row's sequence.
    """

    layer_idx: int
    host_slots: tuple[int, ...]
    rows: tuple[int, ...]
    chunk_idx: tuple[int, ...]


def cut_pieces(chunks_by_layer: list[list[tuple[int, int, int]]], piece_chunks: int) -> list[Piece]:
    """Pieces for every layer, layer-major, from each layer's ``(host_slot, row, chunk_idx)``
    triples (the chunks that layer streams)."""
    pieces = []
    for layer, needed in enumerate(chunks_by_layer):
        for start in range(0, len(needed), piece_chunks):
            group = needed[start : start + piece_chunks]
            pieces.append(
                Piece(
                    layer,
                    tuple(g[0] for g in group),
                    tuple(g[1] for g in group),
                    tuple(g[2] for g in group),
                )
            )
    return pieces


class StagingRing:
    """Copies pieces host → device ahead of need, within a fixed staging allowance.

    Args:
        layout: the chunk layout.
        host: the slot-major host pool the chunks are read from.
        device: where the staging ring lives.
        staging_bytes: the device allowance for the ring.
        lookahead: pieces submitted ahead of the one being consumed.
        prefetch: False submits a piece only when it is needed (synchronous fetch).
        link: bandwidth throttle and in-flight bound of the device⇄host link.
    """

    def __init__(
        self,
        layout: KVLayout,
        host: PoolTier,
        device: torch.device,
        staging_bytes: int,
        lookahead: int,
        prefetch: bool,
        link: LinkConfig,
    ) -> None:
        self.layout = layout
        self.host = host
        self.prefetch = prefetch
        if staging_bytes < layout.layer_nbytes:
            raise ValueError(
                f"staging_bytes: {staging_bytes} is below one chunk's layer slice "
                f"({layout.layer_nbytes} bytes), the least a piece can hold"
            )
        # Fewer ring slots than asked when the allowance cannot hold lookahead + 1 pieces.
        wanted = lookahead + 1 if prefetch else 1
        self.ring_slots = min(wanted, staging_bytes // layout.layer_nbytes)
        self.piece_chunks = staging_bytes // (self.ring_slots * layout.layer_nbytes)
        _, two, heads, tokens, dim = layout.chunk_shape
        # [ring, 2 (k, v), H, piece_chunks, T, D]: a piece's K (or V) is one [H, n*T, D] sequence.
        self.stage = torch.zeros(
            (self.ring_slots, two, heads, self.piece_chunks, tokens, dim),
            dtype=layout.dtype,
            device=device,
        )
        self._cuda = device.type == "cuda"
        throttle = Throttle(link.gbps, link.latency_ms) if link.gbps is not None else None
        self.link = Link(
            "host->device",
            max_inflight_bytes=max(link.max_inflight_bytes, self.slot_nbytes),
            throttle=throttle,
            device=device if self._cuda else None,
        )
        self._pieces: list[Piece] = []
        self._handles: dict[int, TransferHandle] = {}
        self._next_submit = 0

    @property
    def slot_nbytes(self) -> int:
        """Bytes of one ring slot (one full piece)."""
        return self.piece_chunks * self.layout.layer_nbytes

    @property
    def staging_nbytes(self) -> int:
        """Device bytes the ring occupies: the fixed staging allowance actually used."""
        return self.stage.numel() * self.stage.element_size()

    def start(self, pieces: list[Piece]) -> None:
        """Begin a forward pass over ``pieces``; with prefetch, the first ones start now."""
        self.finish()
        self._pieces = pieces
        self._next_submit = 0
        if self.prefetch:
            while self._next_submit < min(len(pieces), self.ring_slots):
                self._submit(self._next_submit)

    def acquire(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Wait for piece ``index`` and return its keys and values, ``[H, n*T, D]`` each.

        The views stay valid until ``release(index)``.
        """
        if index not in self._handles:
            self._submit(index)
        self._handles[index].wait_layer(0)
        n = len(self._pieces[index].host_slots)
        slot = self.stage[index % self.ring_slots]
        heads, dim = slot.shape[1], slot.shape[-1]
        return slot[0, :, :n].reshape(heads, -1, dim), slot[1, :, :n].reshape(heads, -1, dim)

    def release(self, index: int) -> None:
        """Piece ``index`` has been consumed: its slot takes the next piece."""
        self._handles.pop(index, None)
        if self.prefetch and self._next_submit < len(self._pieces):
            self._submit(self._next_submit)

    def finish(self) -> None:
        """Wait for every piece still in flight (their slots must not be rewritten)."""
        for handle in self._handles.values():
            handle.wait()
        self._handles.clear()

    def stats(self) -> LinkStats:
        return self.link.stats()

    def describe(self) -> str:
        return self.link.describe()

    def close(self) -> None:
        self.finish()
        self.link.close()

    def _submit(self, index: int) -> None:
        piece = self._pieces[index]
        target = self.stage[index % self.ring_slots]
        host, layer = self.host, piece.layer_idx

        def copy() -> None:
            for j, slot in enumerate(piece.host_slots):
                # [2, H, T, D] of one chunk's layer, into position j of the ring slot
                # (decoded here, on the link's worker, when the host pool is coded).
                host.layer_into(slot, layer, target[:, :, j])

        nbytes = len(piece.host_slots) * host.layer_stored_nbytes  # what crosses the link
        self.host.count_reads(0, nbytes)
        self._handles[index] = self.link.submit([CopyStep(nbytes, range(0, 1), copy)], 1)
        self._next_submit = max(self._next_submit, index + 1)
