"""The host tier in a lossy codec (``HostConfig.codec``): what it stores and gives back, how
many chunks its budget holds, that only encoded bytes cross the device link, and that the
paths which read the host pool in place refuse it or decode first."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvtier.codec import get_codec
from kvtier.config import (
    CODEC_NAMES,
    DiskConfig,
    HostConfig,
    ManagerConfig,
    PlacementRates,
    TieredCacheConfig,
)
from kvtier.hf import TieredCache
from kvtier.kv import KVLayout
from kvtier.manager import KVManager
from kvtier.models import model_identity, random_model
from kvtier.tiers import host_tier
from tests.conftest import make_chunks

LOSSY = [c for c in CODEC_NAMES if c != "raw"]
CHUNK = 16


def _round_trip(codec: str, data: torch.Tensor, layout: KVLayout) -> torch.Tensor:
    out = torch.empty_like(data)
    get_codec(codec).decode_into(get_codec(codec).encode(data, layout), out)
    return out


@pytest.mark.parametrize("codec", CODEC_NAMES)
def test_a_host_gives_back_its_codecs_round_trip_and_its_budget_counts_stored_bytes(
    codec: str, layout: KVLayout
) -> None:
    host = host_tier(layout, 4 * layout.chunk_nbytes, pin_memory=False, codec=codec)
    stored = get_codec(codec).encoded_nbytes(layout)
    assert host.stored_chunk_nbytes == stored
    assert host.num_slots == 4 * layout.chunk_nbytes // stored  # int8 holds 10, not 4
    chunks = make_chunks(layout, host.num_slots)
    assert len(host.put(chunks).stored) == host.num_slots and host.stats().evictions == 0
    assert host.used_bytes <= host.capacity_bytes
    assert host.pool.nbytes <= host.capacity_bytes
    for chunk in chunks[:3]:
        out = torch.full(layout.chunk_shape, float("nan"))
        assert host.read(chunk.ref, out) == "ok"
        # Encoded layer by layer, the groups are the whole chunk's: the same values.
        assert torch.equal(out, _round_trip(codec, chunk.data, layout))
        if codec == "raw":
            assert torch.equal(out, chunk.data)
    host.close()


@pytest.mark.parametrize("codec", LOSSY)
def test_a_coded_host_decodes_one_layer_into_a_strided_buffer_and_views_are_copies(
    codec: str, layout: KVLayout
) -> None:
    host = host_tier(layout, 4 * layout.chunk_nbytes, pin_memory=False, codec=codec)
    chunk = make_chunks(layout, 1, seed=4)[0]
    host.put([chunk])
    expected = _round_trip(codec, chunk.data, layout)
    slot = host.slot_of(chunk.ref)
    assert slot is not None
    _, two, heads, tokens, dim = layout.chunk_shape
    ring = torch.full((two, heads, 3, tokens, dim), float("nan"))  # a staging slot's shape
    for layer in range(layout.num_layers):
        host.layer_into(slot, layer, ring[:, :, 1])
        assert torch.equal(ring[:, :, 1], expected[layer])
    assert torch.isnan(ring[:, :, 0]).all() and torch.isnan(ring[:, :, 2]).all()
    with pytest.raises(ValueError, match=f"{codec} pool holds encoded bytes"):
        host.slot_data(slot)
    assert host.pin([chunk.ref]) == [True]
    view = host.view(chunk.ref)
    assert view is not None and torch.equal(view, expected)
    view.zero_()  # the caller's own copy: the slot is untouched
    out = torch.empty(layout.chunk_shape)
    assert host.read(chunk.ref, out) == "ok" and torch.equal(out, expected)
    host.unpin([chunk.ref])
    host.close()


def test_a_coded_host_is_slot_major_and_refuses_a_caller_owned_pool(layout: KVLayout) -> None:
    from kvtier.tiers import PoolTier

    with pytest.raises(ValueError, match="slot-major"):
        PoolTier("host", layout, 4 * layout.chunk_nbytes, layer_major=True, codec="int8")


def test_host_codec_is_configured_and_refused_in_one_line() -> None:
    assert HostConfig().codec == "raw"  # exact unless chosen
    assert HostConfig(codec="int8").codec == "int8"
    with pytest.raises(ValueError, match=r"host\.codec: unknown 'int2'; accepted"):
        HostConfig(codec="int2")


def test_a_victim_of_a_coded_host_goes_down_decoded(layout: KVLayout, tmp_path: Path) -> None:
    """Write-back hands the evicted chunk's decoded values to a raw disk."""
    config = ManagerConfig(
        chunk_tokens=layout.chunk_tokens,
        host=HostConfig(capacity_bytes=layout.chunk_nbytes, codec="int8"),
        lower_tiers=(DiskConfig(path=str(tmp_path), capacity_bytes=16 * layout.chunk_nbytes),),
    )
    manager = KVManager(layout, "m", config)
    slots = manager.host.num_slots
    chunks = make_chunks(layout, slots + 2, seed=6)
    manager.store(chunks)
    manager.wait_writes()
    disk = manager.tier("disk")
    first = chunks[0]
    out = torch.empty(layout.chunk_shape)
    assert disk.read(first.ref, out) == "ok"
    assert torch.equal(out, _round_trip("int8", first.data, layout))
    manager.close()


def _model_and_layout() -> tuple[torch.nn.Module, KVLayout]:
    model = random_model("llama", seed=1)
    return model, KVLayout.from_model_config(model.config, torch.float32, CHUNK)


def _generate(
    model: torch.nn.Module, layout: KVLayout, codec: str, **config: object
) -> tuple[torch.Tensor, torch.Tensor, TieredCache]:
    manager = KVManager(
        layout,
        model_identity(model),
        ManagerConfig(
            chunk_tokens=CHUNK,
            host=HostConfig(capacity_bytes=64 * layout.chunk_nbytes, codec=codec),
        ),
    )
    cache = TieredCache(
        model,
        TieredCacheConfig(
            device_budget_bytes=layout.chunk_nbytes, staging_bytes=2 * layout.layer_nbytes, **config
        ),
        manager=manager,
    )
    ids = torch.randint(3, 256, (1, 83), generator=torch.Generator().manual_seed(3))
    out = model.generate(
        ids, cache=cache, max_new_tokens=8, do_sample=False, pad_token_id=0,
        output_scores=True, return_dict_in_generate=True,
    )  # fmt: skip
    return out.sequences, torch.stack(out.scores), cache


@pytest.mark.parametrize("codec", LOSSY)
def test_decode_streams_a_coded_hosts_encoded_bytes_and_attends_the_decoded_values(
    codec: str,
) -> None:
    """Budget of one chunk: every sealed chunk streams from host at every step. The link
    carries the codec's bytes, the prefill's logits are exact (nothing read back yet), the
    steps after it read quantised keys and values: close to raw's, not equal."""
    model, layout = _model_and_layout()
    _, raw_scores, raw_cache = _generate(model, layout, "raw")
    _, scores, cache = _generate(model, layout, codec)
    raw_bytes, coded_bytes = raw_cache.stats().link.bytes, cache.stats().link.bytes
    assert raw_bytes > 0
    assert coded_bytes * layout.chunk_nbytes == raw_bytes * cache.manager.host.stored_chunk_nbytes
    raw_reads, reads = raw_cache.stats().decisions["stream"], cache.stats().decisions["stream"]
    assert reads.chunks == raw_reads.chunks  # the same reads, each the codec's bytes
    assert (
        reads.nbytes * layout.chunk_nbytes
        == raw_reads.nbytes * cache.manager.host.stored_chunk_nbytes
    )
    assert torch.equal(scores[0], raw_scores[0])
    later = scores[1:] - raw_scores[1:]
    assert later.abs().max() > 0
    assert later.abs().max() < 0.05 * raw_scores[1:].abs().max()


def test_placement_host_needs_a_raw_host_and_auto_streams_over_a_coded_one() -> None:
    model, layout = _model_and_layout()
    with pytest.raises(ValueError, match=r"placement 'host' .* needs host codec 'raw'"):
        _generate(model, layout, "int8", placement="host")
    rates = PlacementRates(  # host attention far faster than the link: auto would host all
        link_gbps=0.001, host_attention_gbps=1000.0, device_attention_gbps=1.0, compute_s=0.0
    )
    _, _, cache = _generate(model, layout, "int8", placement="auto", rates=rates)
    assert cache.stats().link.bytes > 0  # all streamed: a coded pool is never attended in place
