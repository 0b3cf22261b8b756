"""``SequenceKV``: one batch of sequences' KV across the device arena and the tiers.

The framework-free core under the adapters (``kvtier.hf``) and the engine. A forward pass
over it is three calls::

    begin_forward(new_tokens, rows, ids, padding)   plan: pin what is needed, start streams
    write(layer, keys, values) -> LayerKV            per layer: keep the new K/V, view it
    end_forward()                                    seal completed chunks, place, unpin

Between ``begin_forward`` and ``end_forward`` attention reads each layer's ``LayerKV``
(``kvtier.runtime.dispatch``). A pass that raises midway is dropped by the next
``begin_forward`` (or ``reset``). Sealed chunks go to host (and on through the manager's
write policy) once, and the arena keeps on the device what each layer group's rule says.

Thread-safety: one pass at a time, from one thread; the tiers below may be shared.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvtier.config import TieredCacheConfig
from kvtier.kv.chunk import Chunk, ChunkRef
from kvtier.kv.layout import KVLayout
from kvtier.kv.spec import check_update
from kvtier.manager import KVManager, LookupResult
from kvtier.runtime import reuse
from kvtier.runtime.arena import DeviceArena
from kvtier.runtime.cost import hosted_counter
from kvtier.runtime.groups import LayerGroup, layer_groups
from kvtier.runtime.ledger import Ledger
from kvtier.runtime.plan import ForwardPlan, hosted_view, plan_forward, release
from kvtier.runtime.seats import SeatSlab
from kvtier.runtime.staging import StagingRing
from kvtier.runtime.state import SequenceState
from kvtier.runtime.stats import CacheStats
from kvtier.runtime.view import LayerKV
from kvtier.tiers.base import TierStats
from kvtier.tiers.pool import PoolTier
from kvtier.transfer import LinkStats


class SequenceKV:
    """The KV of ``rows`` sequences that advance together (the engine uses one row).

    Args:
        manager: the host (and lower) tiers; its layout is the model's.
        windows: per layer, the sliding window (None: full attention).
        config: device budget, staging, look-ahead, sinks, link.
        device: where the arena and the staging ring live.
        model_type: named in errors about the model's tensors.
        seat: ``(slab, index)``: the device pool and tail live in that row of an engine's
            ``SeatSlab`` (one row, full attention only; ``kvtier.runtime.decode`` then
            attends its decode steps with the other seats'); None: its own.
    """

    def __init__(
        self,
        manager: KVManager,
        windows: Sequence[int | None],
        config: TieredCacheConfig,
        device: torch.device,
        model_type: str = "model",
        seat: tuple[SeatSlab, int] | None = None,
    ) -> None:
        if not isinstance(manager.host, PoolTier):
            raise ValueError("manager: the host tier must be a memory pool (PoolTier)")
        if len(windows) != manager.layout.num_layers:
            raise ValueError(
                f"windows: one per layer ({manager.layout.num_layers}), got {len(windows)}"
            )
        self.manager = manager
        self.layout: KVLayout = manager.layout
        self.host: PoolTier = manager.host
        self.config = config
        self.device = device
        self.model_type = model_type
        self.windows = list(windows)
        self.groups: list[LayerGroup] = layer_groups(self.windows)
        self.arena = DeviceArena(
            self.layout, self.groups, config.device_budget_bytes, device, config.sink_chunks, seat
        )
        self.state = SequenceState()
        self.staging: StagingRing | None = None
        self.plan: ForwardPlan | None = None
        self.reused_tokens = 0
        self.pages_tier: str | None = None  # the tier the last reuse's pages came from
        self.sealed_chunks = 0
        self.peak_device_nbytes = 0
        self._hosted_count = hosted_counter(config, self.layout, self.groups, self.host.codec)
        self.ledger = Ledger(  # a chunk read moves the host's stored bytes of its group
            [len(g.layers) * self.host.layer_stored_nbytes for g in self.groups],
            config.rates,
            config.link.gbps,
        )

    @property
    def seq_len(self) -> int:
        return self.state.seq_len

    @property
    def device_nbytes(self) -> int:
        """Device bytes counted against the budget: resident chunks plus the tails."""
        return self.arena.device_nbytes

    @property
    def staging_nbytes(self) -> int:
        return self.staging.staging_nbytes if self.staging is not None else 0

    # ---- a forward pass -------------------------------------------------------------------

    def begin_forward(
        self,
        new_tokens: int,
        rows: int,
        ids: torch.Tensor | None = None,
        padding: torch.Tensor | None = None,
    ) -> None:
        """Plan a pass of ``new_tokens`` per row: their ids ``[B, N]`` (None: unknown, the
        chunks they seal are private) and the ``[B, kv_length]`` padding mask (True = real).

        Raises:
            ChunkLostError: a sealed chunk is in no tier (nothing changed; resume the
                sequence from its cached prefix).
            ValueError: the batch size changed, or the budget cannot hold the tails.
        """
        self.drop_forward()
        self.start_batch(rows)
        staging = self.staging
        assert staging is not None
        tail_before = self.state.tail_len
        token_ids, valid = self.state.extended(ids, new_tokens, padding)
        args = (self.state, valid, self.arena, self.host, self.manager, staging, new_tokens)
        plan = plan_forward(*args, self._hosted_count)
        plan.token_ids, plan.valid = token_ids, valid
        size = self.layout.chunk_tokens
        if tail_before + new_tokens > size:
            self.arena.ensure_open(rows, (tail_before + new_tokens) // size)
        self.plan = plan
        staging.start(plan.pieces)
        self.peak_device_nbytes = max(self.peak_device_nbytes, self.device_nbytes)
        self.ledger.record(plan.ranges)

    def write(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor) -> LayerKV:
        """Keep one layer's new K/V ``[B, Hkv, N, D]`` and return what its attention reads.

        Raises:
            UnsupportedModelError: the keys do not match the layout (before any change).
        """
        layout = self.layout
        if (
            keys.dim() != 4
            or keys.shape[1] != layout.num_kv_heads
            or (keys.shape[3] != layout.head_dim)
        ):
            check_update(self.model_type, layer_idx, keys, layout.num_kv_heads, layout.head_dim)
        plan, tails, staging = self.plan, self.arena.tails, self.staging
        assert plan is not None and tails is not None and staging is not None
        n = keys.shape[2]
        size = layout.chunk_tokens
        before = plan.tail_before
        tail_k = tails[:, layer_idx, 0]  # [B, H, T, D]
        tail_v = tails[:, layer_idx, 1]
        keys = keys.to(layout.dtype)
        values = values.to(layout.dtype)
        if before + n <= size:
            tail_k[:, :, before : before + n] = keys
            tail_v[:, :, before : before + n] = values
            recent_k, recent_v = tail_k[:, :, : before + n], tail_v[:, :, : before + n]
        else:
            recent_k = torch.cat([tail_k[:, :, :before], keys], dim=2)
            recent_v = torch.cat([tail_v[:, :, :before], values], dim=2)
            full = (before + n) // size
            opened = self.arena.open
            assert opened is not None
            for kv, recent in ((0, recent_k), (1, recent_v)):
                # [B, H, f*T, D] -> [B, f, H, T, D] into the buffer of completed chunks.
                blocks = recent[:, :, : full * size].unflatten(2, (full, size)).transpose(1, 2)
                opened[:, :full, layer_idx, kv].copy_(blocks)
            rest = before + n - full * size
            tail_k[:, :, :rest] = recent_k[:, :, full * size :]
            tail_v[:, :, :rest] = recent_v[:, :, full * size :]
        plan.layers_written = layer_idx + 1
        g, _ = self.arena.where[layer_idx]
        resident = plan.resident[g]
        res_k = res_v = None
        if resident.positions:
            k, v = self.arena.layer_kv(layer_idx)  # [H, S, T, D]
            heads, dim = k.shape[0], k.shape[-1]
            # Slots lo..hi-1 of this layer, end to end: one [H, n*T, D] sequence, no copy.
            res_k = k[:, resident.slots].reshape(heads, -1, dim)
            res_v = v[:, resident.slots].reshape(heads, -1, dim)
        return LayerKV(
            layer_idx=layer_idx,
            window=self.windows[layer_idx],
            query_start=plan.query_start,
            chunk_tokens=size,
            recent_key=recent_k,
            recent_value=recent_v,
            recent_start=plan.sealed_before * size,
            recent_valid=plan.recent_valid,
            resident_key=res_k,
            resident_value=res_v,
            resident_valid=resident.valid,
            resident_chunks=tuple(resident.chunks),
            pieces=tuple(
                (i, plan.pieces[i], plan.piece_valid[i]) for i in plan.pieces_by_layer[layer_idx]
            ),
            staging=staging,
            query_block_tokens=self.config.query_block_tokens,
            hosted=hosted_view(plan, g, layer_idx, self.host, self.ledger.host_spent),
        )

    def end_forward(self) -> None:
        """Seal every chunk completed in the pass, place them by the arena's rules, unpin.

        Does nothing when no pass is open (or it did not reach its last layer: dropped).
        """
        plan = self.plan
        if plan is None:
            return
        if plan.layers_written < self.layout.num_layers:
            self.drop_forward()
            return
        size = self.layout.chunk_tokens
        total = plan.tail_before + plan.new_tokens
        self.drop_forward()  # waits for the stream, then unpins
        state = self.state
        assert plan.token_ids is not None and plan.valid is not None
        state.commit(plan.token_ids, plan.valid)
        if total < size:
            state.tail_len = total
            return
        tails = self.arena.tails
        assert tails is not None
        if total == size:
            data, full = tails[:, None], 1  # the tail filled exactly: [B, 1, L, 2, H, T, D]
        else:
            assert self.arena.open is not None
            full = total // size
            data = self.arena.open[:, :full]
        sealed: list[tuple[int, int, Chunk]] = []
        for row in range(state.rows):
            for j in range(full):
                ref = state.next_ref(row, self.manager.hasher, size)
                sealed.append((row, len(state.refs[row]), Chunk(ref, data[row, j])))
                state.refs[row].append(ref)
        self.manager.store([c for _, _, c in sealed])
        self.sealed_chunks += len(sealed)
        self.arena.place(sealed, state.refs)
        state.tail_len = total - full * size

    def drop_forward(self) -> None:
        """Release the open pass's pins and streams without sealing (after an error)."""
        plan = self.plan
        if plan is None:
            return
        if self.staging is not None:
            self.staging.finish()
        release(plan, self.host)
        self.plan = None

    # ---- sequences ----------------------------------------------------------------------

    def prefix_limit(self, num_tokens: int) -> int:
        """``KVLayout.prefix_limit`` of this sequence's layout."""
        return self.layout.prefix_limit(num_tokens)

    def reuse_prefix(
        self,
        input_ids: torch.Tensor,
        salt: str = "",
        match: LookupResult | None = None,
        pages: bool = True,
    ) -> int:
        """Adopt the longest cached prefix of a prompt from any tier; returns its tokens.

        Call on an empty state. Whole chunks first, then (one row) a partial chunk's whole
        pages; at least one prompt token is left to compute. See ``kvtier.runtime.reuse``.
        ``salt`` is the tenant's: only chunks keyed under it are adopted, and the chunks
        sealed until ``reset`` are keyed under it too. ``match``: the caller's lookup of
        the one row's ``input_ids[:prefix_limit]`` under ``salt``; None looks it up here.
        ``pages=False`` adopts whole chunks only (more may follow: ``adopt_loaded``).
        """
        if self.state.seq_len:
            raise ValueError("reuse_prefix: the cache already holds tokens; call reset() first")
        ids = input_ids.detach().to("cpu", torch.int64)
        if ids.dim() == 1:
            ids = ids.unsqueeze(0)
        self.state.salt, self.pages_tier = salt, None
        hit = reuse.adopt_chunks(self, ids, salt, match)
        if ids.shape[0] == 1 and pages:
            hit += reuse.adopt_pages(self, ids)
        self.reused_tokens = hit
        return hit

    def adopt_loaded(self, input_ids: torch.Tensor, refs: list[ChunkRef]) -> int:
        """After the sealed chunks (one row, no tail), adopt the leading run of ``refs``
        that host holds now, without waiting on a lower tier; returns its tokens. The
        engine computes a reused prefix's front while its back loads, then adopts the back
        here. See ``kvtier.runtime.reuse.adopt_loaded``."""
        ids = input_ids.detach().to("cpu", torch.int64).reshape(1, -1)
        hit = reuse.adopt_loaded(self, ids, refs)
        self.reused_tokens += hit
        return hit

    def seal_partial(self, upto: int | None = None) -> int:
        """Store the tail's whole pages up to position ``upto`` (default: all it holds) as a
        partial chunk, so a later prompt that shares them reuses them; returns the tokens
        stored (0: none). One row; nothing changes in this sequence. See
        ``kvtier.runtime.reuse.seal_pages``."""
        return reuse.seal_pages(self, self.state.seq_len if upto is None else upto)

    def reserve(self, open_chunks: int = 2) -> None:
        """Allocate and touch the buffers of a one-sequence batch now: the arena, the
        buffer for ``open_chunks`` chunks completed in one pass (a prefill piece of ``n``
        chunks needs ``n + 1``), and the staging ring with its link.

        A serving engine reserves at start, so no request pays the first touch of fresh
        memory and the device budget is taken up front. The state stays empty.
        """
        if self.state.seq_len:
            raise ValueError("reserve: the cache already holds tokens; call reset() first")
        self.start_batch(1)
        self.arena.ensure_open(1, max(1, open_chunks))
        self.state.reset()

    def crop(self, num_tokens: int) -> None:
        """Drop the last ``num_tokens`` tokens (only tokens of the unsealed tail)."""
        self.state.crop(num_tokens)

    def reset(self) -> None:
        """Forget the sequences (their sealed chunks stay in the tiers for reuse)."""
        self.drop_forward()
        self.arena.unpin_sinks()
        self.state.reset()

    def clear_device(self) -> None:
        """Drop every resident chunk (they stay in host); the state must be empty."""
        self.arena.clear()

    def stats(self) -> CacheStats:
        staging = self.staging
        link = staging.stats() if staging is not None else LinkStats()
        return CacheStats(
            device=self.arena.stats() if self.arena.pools else TierStats(),
            host=self.host.stats(),
            link=link,
            link_description=staging.describe() if staging is not None else "idle",
            device_budget_bytes=self.config.device_budget_bytes,
            device_nbytes=self.device_nbytes,
            staging_nbytes=self.staging_nbytes,
            reused_tokens=self.reused_tokens,
            sealed_chunks=self.sealed_chunks,
            decisions=self.ledger.snapshot(link.busy_s),
        )

    def close(self) -> None:
        """Stop the link and release the arena (host/disk chunks stay for reuse)."""
        self.reset()
        if self.staging is not None:
            self.staging.close()
            self.staging = None
        self.arena.close()

    def start_batch(self, rows: int) -> None:
        """Size the arena and the ring for ``rows``; an empty state starts the batch.

        Raises:
            ValueError: the batch size changed, or the budget cannot hold the tails.
        """
        state = self.state
        if state.rows and rows != state.rows:
            raise ValueError(
                f"batch size changed from {state.rows} to {rows}; call reset() between batches"
            )
        if not state.rows:
            self.arena.ensure(rows)
            state.start(rows)
        if self.staging is None:
            config = self.config
            self.staging = StagingRing(
                self.layout,
                self.host,
                self.device,
                config.staging_bytes,
                config.lookahead,
                config.prefetch,
                config.link,
            )
