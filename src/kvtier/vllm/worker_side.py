"""The connector's worker side: chunks into vLLM's blocks before a forward, and out after.

``start_load`` brings each planned chunk into the host tier (promoting it from disk or
the shared tier, checksums checked there) and pins it; ``wait_layer`` then scatters that
layer of every pinned chunk into its blocks just before the layer's attention reads them
(vLLM's layer-wise hook), and the pins drop after the last layer. A chunk that is missing
or corrupt, and every chunk after it in the request, is not loaded: its blocks go to
``take_failed_blocks`` and vLLM recomputes them, so a failed load costs time, never a
wrong token. ``save`` gathers the chunks a forward completed into one reused buffer and
stores them in the host tier; the manager writes them down the stack behind compute.

Buffers: ``kv_layers`` are vLLM's (registered once, written only by ``wait_layer``); the
gather buffer is this object's. Thread-safety: one vLLM worker thread calls it.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

import torch

from kvtier.kv.chunk import Chunk, ChunkRef
from kvtier.manager import KVManager
from kvtier.vllm.metadata import RequestLoad, RequestSave
from kvtier.vllm.paged import PagedLayout, gather_chunk, scatter_layer

log = logging.getLogger(__name__)


def layer_index(name: str) -> int:
    """The decoder layer of a vLLM attention layer name (``model.layers.7.self_attn.attn``)."""
    found = re.findall(r"\.(\d+)\.", f".{name}.")
    if not found:
        raise ValueError(f"layer {name!r}: no layer number in its name")
    return int(found[0])


@dataclass(frozen=True)
class _Pending:
    """A pinned chunk to scatter: its host view and where it goes."""

    ref: ChunkRef
    view: torch.Tensor  # [L, 2, H, T, D], the pinned host slot (read only)
    block_ids: torch.Tensor  # int64
    first_block: int


class WorkerSide:
    """See the module docstring.

    Args:
        manager: the tiers.
        paged: vLLM's block size against kvtier's chunk layout.
    """

    def __init__(self, manager: KVManager, paged: PagedLayout) -> None:
        self.manager = manager
        self.paged = paged
        self.kv_layers: list[torch.Tensor] = []
        self._names: dict[str, int] = {}
        self._pending: list[_Pending] = []
        self._scattered: set[int] = set()
        self._failed: set[int] = set()
        self._buffer = torch.zeros(manager.layout.chunk_shape, dtype=manager.layout.dtype)
        self.loaded_chunks = 0
        self.saved_chunks = 0

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Take vLLM's per-layer KV tensors (checked against the layout).

        Raises:
            UnsupportedPagingError: a layer's shape or dtype is not the CPU backend's.
            ValueError: the layers do not number 0 … L-1.
        """
        order = sorted(kv_caches, key=layer_index)
        if [layer_index(n) for n in order] != list(range(self.manager.layout.num_layers)):
            raise ValueError(
                f"vLLM's KV layers {order} do not match the model's "
                f"{self.manager.layout.num_layers} layers"
            )
        for name in order:
            self.paged.check(name, kv_caches[name])
        self.kv_layers = [kv_caches[n] for n in order]
        self._names = {n: i for i, n in enumerate(order)}

    # ---- loads ------------------------------------------------------------------------------

    def start_load(self, loads: list[RequestLoad]) -> None:
        """Promote and pin every planned chunk; a request's chunks from its first failure
        on are not loaded (their blocks are failed). Blocks on lower tiers' reads."""
        self._release()
        for load in loads:
            refs = [c.ref for c in load.chunks]
            outcomes = self.manager.promote(refs) if refs else []
            pinned = self.manager.host.pin(refs)
            ok = True
            for i, (chunk, outcome, held) in enumerate(
                zip(load.chunks, outcomes, pinned, strict=True)
            ):
                view = self.manager.host.view(chunk.ref) if held else None
                if ok and (outcome != "host" or view is None):
                    ok = False
                    log.warning(
                        "kvtier: request %s: chunk %d of %d not loaded (%s); vLLM recomputes "
                        "from there",
                        load.request_id,
                        i + 1,
                        len(load.chunks),
                        outcome if outcome != "host" else "evicted before it was pinned",
                    )
                if ok and view is not None:
                    ids = torch.tensor(chunk.block_ids, dtype=torch.int64)
                    self._pending.append(_Pending(chunk.ref, view, ids, chunk.first_block))
                else:
                    self._failed.update(chunk.block_ids)
                if held and not ok:
                    self.manager.host.unpin([chunk.ref])
            lost = sum(1 for o in outcomes if o == "missing")
            if lost:
                self.manager.count_recompute("missing", lost)
        self.loaded_chunks += len(self._pending)

    def wait_layer(self, name: str) -> None:
        """Scatter layer ``name`` of every pending chunk into its blocks (once per layer;
        the pins drop after the last layer)."""
        if not self._pending:
            return
        layer = self._names[name]
        if layer in self._scattered:
            return
        for p in self._pending:
            scatter_layer(self.paged, p.view[layer], self.kv_layers[layer], p.block_ids,
                          p.first_block)  # fmt: skip
        self._scattered.add(layer)
        if len(self._scattered) == len(self.kv_layers):
            self._release()

    def finish_step(self) -> None:
        """After the forward: chunks whose layers were not all scattered (vLLM did not
        ask for every layer) are failed, so vLLM recomputes those blocks."""
        if self._pending:
            log.warning(
                "kvtier: %d chunk(s) were not scattered into every layer; vLLM recomputes them",
                len(self._pending),
            )
            for p in self._pending:
                self._failed.update(int(b) for b in p.block_ids)
        self._release()

    def take_failed_blocks(self) -> set[int]:
        """The blocks whose load failed since the last call (then forgotten)."""
        failed, self._failed = self._failed, set()
        return failed

    def _release(self) -> None:
        if self._pending:
            self.manager.host.unpin([p.ref for p in self._pending])
        self._pending = []
        self._scattered = set()

    # ---- saves ------------------------------------------------------------------------------

    def save(self, saves: list[RequestSave]) -> None:
        """Store every planned chunk that no tier holds yet (gathered from its blocks)."""
        n = self.paged.blocks_per_chunk
        for save in saves:
            refs = self.manager.refs_for(save.token_ids, save.salt)[save.first_chunk :]
            for i, ref in enumerate(refs):
                if self.manager.locate(ref) is not None:
                    continue
                ids = torch.tensor(save.block_ids[i * n : (i + 1) * n], dtype=torch.int64)
                gather_chunk(self.paged, self.kv_layers, ids, self._buffer)
                self.manager.store([Chunk(ref, self._buffer)])
                self.saved_chunks += 1
