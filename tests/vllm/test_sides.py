"""The connector's two halves without vLLM: the extra config, vLLM's paged layout against
chunks, the scheduler side's plans and the worker side's loads and saves on a real
``KVManager`` (vLLM's request and scheduler-output records are plain stand-ins here; the
connector under real vLLM is tested in ``test_connector.py``)."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from kvtier.codec import get_codec
from kvtier.config import DiskConfig, HostConfig, LinkConfig, ManagerConfig, RemoteConfig
from kvtier.kv import Chunk, KVLayout
from kvtier.manager import KVManager
from kvtier.vllm.lookup import LookupClient, LookupServer, socket_address
from kvtier.vllm.paged import PagedLayout, UnsupportedPagingError, gather_chunk, scatter_layer
from kvtier.vllm.scheduler_side import SchedulerSide
from kvtier.vllm.settings import for_bursts, manager_config
from kvtier.vllm.worker_side import WorkerSide, layer_index

LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=4, chunk_tokens=16)
BLOCK = 8  # two vLLM blocks a chunk


def kv_layers(num_blocks: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """vLLM CPU-backend layers: ``[blocks, H, block_size, 2 * D]``, random."""
    gen = torch.Generator().manual_seed(seed)
    shape = (num_blocks, LAYOUT.num_kv_heads, BLOCK, 2 * LAYOUT.head_dim)
    return {
        f"model.layers.{i}.self_attn.attn": torch.randn(shape, generator=gen)
        for i in range(LAYOUT.num_layers)
    }


def token_kv(layer: torch.Tensor, block: int, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V ``[H, D]`` of one token as vLLM's kernels read them."""
    view = layer.view(layer.shape[0], LAYOUT.num_kv_heads, 2 * BLOCK, LAYOUT.head_dim)
    return view[block, :, slot], view[block, :, BLOCK + slot]


def manager(
    tmp_path: Path | None = None, host_chunks: int = 8, host_codec: str = "raw"
) -> KVManager:
    lower = ()
    if tmp_path is not None:
        lower = (DiskConfig(path=str(tmp_path), capacity_bytes=64 * LAYOUT.chunk_nbytes),)
    config = ManagerConfig(
        chunk_tokens=LAYOUT.chunk_tokens,
        host=HostConfig(capacity_bytes=host_chunks * LAYOUT.chunk_nbytes, codec=host_codec),
        lower_tiers=lower,
    )
    return KVManager(LAYOUT, "vllm-test", config)


# ---- settings ---------------------------------------------------------------------------------


def test_extra_config_maps_onto_the_tier_stack() -> None:
    config = manager_config(
        {"host_mb": 64, "disk_dir": "/tmp/kv", "disk_mb": 128, "remote": "redis://h:1",
         "remote_ttl_s": 0, "salt": "t1", "write_policy": "write_through",
         "disk_codec": "int8", "remote_codec": "fp8", "eviction_policy": "s3fifo+prefix",
         "host_codec": "int4"}
    )  # fmt: skip
    assert config.host.capacity_bytes == 64 << 20 and config.tenant_salt == "t1"
    disk, remote = config.lower_tiers
    assert isinstance(disk, DiskConfig) and disk.path == "/tmp/kv"
    assert disk.capacity_bytes == 128 << 20
    assert isinstance(remote, RemoteConfig) and remote.ttl_s is None
    assert config.write_policy == "write_through" and manager_config(None).lower_tiers == ()
    assert (config.host.codec, disk.codec, remote.codec) == ("int4", "int8", "fp8")
    assert config.host.eviction_policy == disk.eviction_policy == "s3fifo+prefix"
    plain = manager_config({"disk_dir": "/tmp/kv"})
    assert (plain.lower_tiers[0].codec, plain.host.eviction_policy) == ("raw", "lru")
    assert plain.host.codec == "raw"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"host_gb": 4}, r"unknown key\(s\) 'host_gb'; accepted: host_mb"),
        ({"host_mb": 0}, r"kv_connector_extra_config.host_mb: must be an integer >= 1"),
        ({"host_mb": "4G"}, r"host_mb: must be an integer >= 1, got '4G'"),
        ({"remote_timeout_s": -1}, r"remote_timeout_s: must be"),
        ({"disk_dir": 3}, r"disk_dir: must be a string or null"),
        ({"write_policy": "always"}, r"write_policy: unknown 'always'"),
        ({"disk_codec": "zstd"}, r"disk_codec: unknown 'zstd'; accepted: \['raw', 'fp8'"),
        ({"eviction_policy": "lfu"}, r"eviction_policy: unknown 'lfu'; accepted: \['arc'"),
    ],
)
def test_a_bad_extra_config_is_one_line(extra: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message) as refused:
        manager_config(extra)
    assert "\n" not in str(refused.value)


# ---- paged layout -----------------------------------------------------------------------------


def test_gather_lays_blocks_side_by_side_and_scatter_puts_them_back() -> None:
    paged = PagedLayout(LAYOUT, BLOCK)
    layers = list(kv_layers(6).values())
    blocks = torch.tensor([4, 1])  # the chunk's tokens 0-7 in block 4, 8-15 in block 1
    chunk = torch.empty(LAYOUT.chunk_shape)
    gather_chunk(paged, layers, blocks, chunk)
    for layer, kv in enumerate(layers):
        for token in range(LAYOUT.chunk_tokens):
            k, v = token_kv(kv, int(blocks[token // BLOCK]), token % BLOCK)
            assert torch.equal(chunk[layer, 0, :, token], k)
            assert torch.equal(chunk[layer, 1, :, token], v)
    fresh = [torch.zeros_like(kv) for kv in layers]
    for layer, kv in enumerate(fresh):
        scatter_layer(paged, chunk[layer], kv, torch.tensor([2]), first_block=1)
        assert torch.equal(kv[2], layers[layer][1])  # only the second block, into block 2
        assert not kv[torch.arange(6) != 2].any()


def test_paging_that_kvtier_cannot_read_is_refused_in_one_line() -> None:
    with pytest.raises(UnsupportedPagingError, match="not a multiple of vLLM's block size 24"):
        PagedLayout(LAYOUT, 24)
    paged = PagedLayout(LAYOUT, BLOCK)
    with pytest.raises(UnsupportedPagingError, match="CPU backend"):
        paged.check("l0", torch.zeros(2, 4, BLOCK, 2, LAYOUT.head_dim))  # a 5-D GPU layout
    with pytest.raises(UnsupportedPagingError, match="quantised kv_cache_dtype"):
        paged.check("l0", torch.zeros(2, 2, BLOCK, 8, dtype=torch.float16))


# ---- scheduler side ---------------------------------------------------------------------------


def request(req_id: str, tokens: list[int], salt: str | None = None) -> SimpleNamespace:
    return SimpleNamespace(
        request_id=req_id, prompt_token_ids=tokens, all_token_ids=tokens, cache_salt=salt
    )


def step(new: list[tuple[str, list[int], int, int]], cached: list[Any] = ()) -> SimpleNamespace:
    """A scheduler output: ``new`` as (id, block ids, computed, scheduled)."""
    return SimpleNamespace(
        scheduled_new_reqs=[
            SimpleNamespace(req_id=r, block_ids=(b,), num_computed_tokens=c) for r, b, c, _ in new
        ],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[c[0] for c in cached],
            new_block_ids=[(c[1],) for c in cached],
            num_computed_tokens=[c[2] for c in cached],
            resumed_req_ids=set(),
        ),
        num_scheduled_tokens={r: n for r, _, _, n in new} | {c[0]: c[3] for c in cached},
    )


def test_the_scheduler_plans_loads_past_vllms_own_hit_and_saves_what_completes() -> None:
    with manager() as m:
        ids = list(range(100, 160))  # 60 tokens: 3 whole chunks, the last has 12 left over
        held = ["host", "disk", "host"]
        asked: list[tuple[list[int], str]] = []

        def held_tiers(token_ids: Any, salt: str) -> list[str]:
            asked.append((list(token_ids), salt))
            return list(held)

        side = SchedulerSide(m.hasher, held_tiers, BLOCK, load=True, save=True)
        req = request("a", ids)
        # vLLM holds the first block itself: kvtier loads tokens 8-47.
        assert side.matched_tokens(req, 8) == 40
        assert asked == [(ids[:48], "")]  # the prefix limit: one token is left to compute
        assert side.hit_tiers(req, 40) == {"host": 8 + 16, "disk": 16}
        side.after_alloc(req, list(range(10, 18)), 40)
        plan = side.build(step([("a", list(range(10, 18)), 48, 12)]))
        (load,) = plan.loads
        assert [c.ref for c in load.chunks] == m.refs_for(ids[:48])
        assert [(c.block_ids, c.first_block) for c in load.chunks] == [
            ((11,), 1),
            ((12, 13), 0),
            ((14, 15), 0),
        ]
        assert plan.saves == []  # the forward computes 48-59: no whole chunk completes
        side.finished(req)
        # A second request computes 20 tokens, then 20 more: chunk 0, then chunk 1, saved.
        held.clear()
        other = request("b", list(range(40)), salt="s")
        assert side.matched_tokens(other, 0) == 0 and asked[-1] == (list(range(32)), "s")
        side.after_alloc(other, [3, 4, 5], 0)
        first = side.build(step([("b", [3, 4, 5], 0, 20)]))
        second = side.build(step([], cached=[("b", [6], 20, 20)]))
        assert [(s.first_chunk, s.block_ids, s.salt) for s in first.saves] == [(0, (3, 4), "s")]
        assert [(s.first_chunk, s.block_ids) for s in second.saves] == [(1, (5, 6))]
        assert second.saves[0].token_ids == tuple(range(32))


# ---- worker side ------------------------------------------------------------------------------


def random_chunks(m: KVManager, ids: np.ndarray) -> list[Chunk]:
    gen = torch.Generator().manual_seed(9)
    return [Chunk(r, torch.randn(LAYOUT.chunk_shape, generator=gen)) for r in m.refs_for(ids)]


SAVED_FROM = [7, 2, 5, 0]  # the two chunks' vLLM blocks when saved
LOADED_INTO = [1, 3, 4, 6]  # and when loaded (the request's fifth block is computed)


def _save(m: KVManager, side: SchedulerSide, layers: dict[str, torch.Tensor], ids: list[int]
          ) -> WorkerSide:  # fmt: skip
    """Request "a" over ``ids`` (two chunks) saves them from ``SAVED_FROM``."""
    saver = WorkerSide(m, PagedLayout(LAYOUT, BLOCK))
    saver.register(layers)
    side.after_alloc(request("a", ids), SAVED_FROM, 0)
    saver.save(side.build(step([("a", SAVED_FROM, 0, 32)])).saves)
    return saver


def _load(m: KVManager, side: SchedulerSide, ids: list[int], req_id: str
          ) -> tuple[WorkerSide, dict[str, torch.Tensor], Any]:  # fmt: skip
    """Request ``req_id`` over ``ids`` + one token loads both chunks into ``LOADED_INTO`` of
    fresh layers, every layer scattered; (its worker, the layers, its load)."""
    target = {n: torch.zeros_like(t) for n, t in kv_layers(8).items()}
    loader = WorkerSide(m, PagedLayout(LAYOUT, BLOCK))
    loader.register(target)
    again = request(req_id, [*ids, 9])
    assert side.matched_tokens(again, 0) == 32
    side.after_alloc(again, [*LOADED_INTO, 2], 32)
    (load,) = side.build(step([(req_id, [*LOADED_INTO, 2], 32, 1)])).loads
    loader.start_load([load])
    for name in target:
        loader.wait_layer(name)
    return loader, target, load


def test_saved_chunks_load_into_other_blocks_bit_exact(tmp_path: Path) -> None:
    """Save from one set of vLLM blocks, evict host to disk, load into other blocks; once
    the first chunk is lost, nothing loads and every planned block is failed."""
    layers = kv_layers(8, seed=1)
    ids = list(range(500, 532))  # two chunks
    with manager(tmp_path, host_chunks=2) as m:
        side = SchedulerSide(m.hasher, lambda t, s: m.lookup(t, s).tiers, BLOCK, True, True)
        assert _save(m, side, layers, ids).saved_chunks == 2
        m.store(random_chunks(m, np.arange(9_000, 9_000 + 64)))  # evicts them to disk
        m.wait_writes()
        assert m.lookup(ids).tiers == ["disk", "disk"]

        loader, target, load = _load(m, side, ids, "c")
        for name, layer in target.items():
            for dst, src in zip(LOADED_INTO, SAVED_FROM, strict=True):
                assert torch.equal(layer[dst], layers[name][src])
        assert loader.take_failed_blocks() == set() and loader.loaded_chunks == 2

        m.tier("disk").remove([load.chunks[0].ref])  # lost since the plan was made
        m.host.remove([load.chunks[0].ref])
        loader.start_load([load])
        loader.finish_step()
        assert loader.take_failed_blocks() == set(LOADED_INTO)
        assert m.stats().recomputed_chunks_by_cause["missing"] == 1


def test_blocks_saved_through_an_int8_host_load_as_its_round_trip() -> None:
    """A coded host: what vLLM gets back is the codec's round trip of what it saved."""
    layers = kv_layers(8, seed=3)
    ids = list(range(700, 732))  # two chunks
    with manager(host_codec="int8") as m:
        side = SchedulerSide(m.hasher, lambda t, s: m.lookup(t, s).tiers, BLOCK, True, True)
        _save(m, side, layers, ids)
        loader, target, _ = _load(m, side, ids, "b")
        assert loader.take_failed_blocks() == set() and loader.loaded_chunks == 2
        paged, codec = PagedLayout(LAYOUT, BLOCK), get_codec("int8")
        saved = [torch.empty(LAYOUT.chunk_shape) for _ in range(2)]
        got = [torch.empty(LAYOUT.chunk_shape) for _ in range(2)]
        for j in range(2):
            pair = slice(2 * j, 2 * j + 2)
            gather_chunk(paged, list(layers.values()), torch.tensor(SAVED_FROM[pair]), saved[j])
            gather_chunk(paged, list(target.values()), torch.tensor(LOADED_INTO[pair]), got[j])
        for want, have in zip(saved, got, strict=True):
            expected = torch.empty_like(want)
            codec.decode_into(codec.encode(want, LAYOUT), expected)
            assert torch.equal(have, expected) and not torch.equal(have, want)


@pytest.mark.parametrize("sized", [False, True])
def test_one_steps_burst_of_saves_reaches_disk_whole_when_sized_for_it(
    tmp_path: Path, sized: bool
) -> None:
    """One forward completes 12 chunks and the host tier holds 2: each save evicts one.
    With the hop below host sized for the step (``for_bursts``, as the connector does),
    all 12 are on disk or host afterwards; with kvtier's default queue of 4, most are
    dropped (and would be recomputed). The disk's link takes 100 ms a write, so the burst
    always outruns it (a fast tmpfs could otherwise drain a small burst as it comes)."""
    num_chunks = 12
    slow_link = LinkConfig(gbps=100.0, latency_ms=100.0)
    config = ManagerConfig(
        chunk_tokens=LAYOUT.chunk_tokens,
        host=HostConfig(capacity_bytes=2 * LAYOUT.chunk_nbytes),
        lower_tiers=(
            DiskConfig(path=str(tmp_path), capacity_bytes=64 * LAYOUT.chunk_nbytes, link=slow_link),
        ),
    )
    if sized:
        config = for_bursts(config, num_chunks * LAYOUT.chunk_tokens, LAYOUT.chunk_nbytes)
        assert config.lower_tiers[0].write_queue_chunks == num_chunks
    blocks = list(range(2 * num_chunks))
    ids = list(range(1_000, 1_000 + num_chunks * LAYOUT.chunk_tokens))
    with KVManager(LAYOUT, "vllm-test", config) as m:
        side = SchedulerSide(m.hasher, lambda t, s: m.lookup(t, s).tiers, BLOCK, True, True)
        saver = WorkerSide(m, PagedLayout(LAYOUT, BLOCK))
        saver.register(kv_layers(len(blocks), seed=2))
        side.after_alloc(request("a", ids), blocks, 0)
        saver.save(side.build(step([("a", blocks, 0, len(ids))])).saves)
        m.wait_writes()
        held = len(m.lookup(ids).tiers)
        dropped = m.stats().write_backs_dropped
    if sized:
        assert (held, dropped) == (num_chunks, 0)
    else:
        assert held < num_chunks and dropped > 0


def test_layer_names_and_a_short_register_are_checked() -> None:
    assert layer_index("model.layers.12.self_attn.attn") == 12
    with manager() as m:
        side = WorkerSide(m, PagedLayout(LAYOUT, BLOCK))
        layers = kv_layers(2)
        layers.pop("model.layers.1.self_attn.attn")
        with pytest.raises(ValueError, match="do not match the model's 3 layers"):
            side.register(layers)


# ---- lookups across processes -----------------------------------------------------------------


def test_the_scheduler_asks_the_workers_tiers_over_a_socket() -> None:
    ids = np.arange(48)
    with manager() as m:
        m.store(random_chunks(m, ids[:32]))
        address = socket_address(f"test-{os.getpid()}")
        server = LookupServer(m, address)
        client = LookupClient(address)
        try:
            assert client.held_tiers(ids, "") == ["host", "host"]
            assert client.held_tiers(ids, "other tenant") == []
        finally:
            client.close()
            server.close()
        assert LookupClient(address).held_tiers(ids, "") == []  # gone: a miss
