"""Every lower tier (disk, the shared Redis one) × every codec: what is stored is what the
codec gives back, the budget counts stored bytes, and a chunk stored with one codec is never
read as another (a miss or a corrupt chunk, counted; never decoded)."""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

from kvtier.codec import CODECS, get_codec
from kvtier.config import CODEC_NAMES, DiskConfig, RemoteConfig
from kvtier.kv import KVLayout
from kvtier.tiers import Tier
from kvtier.tiers import remote_format as rf
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.disk_format import SlotFormat, segment_name
from tests.conftest import make_chunks

if TYPE_CHECKING:
    from kvbench.redis_cluster import RedisCluster

LOWER_KINDS = ["disk", "remote"]


def _expected(codec: str, data: torch.Tensor, layout: KVLayout) -> torch.Tensor:
    """What a tier in ``codec`` gives back for ``data``: the codec's own round trip."""
    out = torch.empty_like(data)
    get_codec(codec).decode_into(get_codec(codec).encode(data, layout), out)
    return out


@pytest.fixture
def make_tier(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, object]]:
    made: list[Tier] = []
    kind: str = request.param

    def make(layout: KVLayout, codec: str, num_chunks: int, path: Path | None = None,
             prefix: str | None = None) -> Tier:  # fmt: skip
        capacity = num_chunks * get_codec(codec).encoded_nbytes(layout)
        if kind == "disk":
            tier: Tier = DiskTier(layout, path or tmp_path, capacity, codec=codec)
        else:
            from kvtier.tiers.remote import RemoteTier

            url = request.getfixturevalue("redis_cluster").url
            config = RemoteConfig(
                url=url, key_prefix=prefix or "codec", cluster=True, timeout_s=5.0,
                capacity_bytes=capacity, codec=codec,
            )  # fmt: skip
            tier = RemoteTier(layout, config)
        made.append(tier)
        return tier

    yield kind, make
    for tier in made:
        tier.close()


@pytest.mark.parametrize("make_tier", LOWER_KINDS, indirect=True)
@pytest.mark.parametrize("codec", CODEC_NAMES)
def test_a_tier_gives_back_its_codecs_round_trip(
    make_tier: tuple[str, object], codec: str, layout: KVLayout
) -> None:
    _, make = make_tier
    tier = make(layout, codec, 4, prefix=f"t{uuid.uuid4().hex[:10]}")  # type: ignore[operator]
    chunks = make_chunks(layout, 3)
    assert len(tier.put(chunks).stored) == 3
    stored_nbytes = get_codec(codec).encoded_nbytes(layout)
    assert tier.stored_chunk_nbytes == stored_nbytes
    for chunk in chunks:
        out = torch.full(layout.chunk_shape, float("nan"))
        assert tier.read(chunk.ref, out) == "ok"
        assert torch.equal(out, _expected(codec, chunk.data, layout))
        if codec == "raw":
            assert torch.equal(out, chunk.data)
    stats = tier.stats()
    assert (stats.bytes_in, stats.bytes_out) == (3 * stored_nbytes, 3 * stored_nbytes)


@pytest.mark.parametrize("codec", CODEC_NAMES)
def test_a_disk_budget_holds_more_chunks_in_a_smaller_codec(
    codec: str, layout: KVLayout, tmp_path: Path
) -> None:
    tier = DiskTier(layout, tmp_path, 4 * layout.chunk_nbytes, codec=codec)
    assert tier.num_slots == 4 * layout.chunk_nbytes // get_codec(codec).encoded_nbytes(layout)
    chunks = make_chunks(layout, tier.num_slots)
    assert len(tier.put(chunks).stored) == tier.num_slots and tier.stats().evictions == 0
    assert tier.used_bytes <= tier.capacity_bytes
    tier.close()


@pytest.mark.parametrize("writer", [c for c in CODEC_NAMES])
def test_a_disk_chunk_is_never_read_in_another_codec(
    writer: str, layout: KVLayout, tmp_path: Path
) -> None:
    chunks = make_chunks(layout, 2)
    tier = DiskTier(layout, tmp_path, 4 * layout.chunk_nbytes, codec=writer)
    tier.put(chunks)
    tier.close()
    for reader in CODEC_NAMES:
        other = DiskTier(layout, tmp_path, 4 * layout.chunk_nbytes, codec=reader)
        out = torch.full(layout.chunk_shape, 7.0)
        held = reader == writer
        assert other.contains(chunks[0].ref) is held
        assert other.read(chunks[0].ref, out) == ("ok" if held else "missing")
        if not held:
            assert torch.all(out == 7.0)
        other.close()


def test_a_disk_segment_of_another_codec_under_this_codecs_name_is_dropped_as_corrupt(
    layout: KVLayout, tmp_path: Path
) -> None:
    """The header names the codec: even a file renamed to pass as another codec's segment
    is dropped at open (counted), not decoded."""
    chunks = make_chunks(layout, 2)
    tier = DiskTier(layout, tmp_path / "a", 4 * layout.chunk_nbytes, codec="int8")
    tier.put(chunks)
    source, _ = tier.slot_location(0)
    slots = tier.segment_slots
    tier.close()
    int4 = SlotFormat.for_layout(layout, get_codec("int4"))
    os.makedirs(tmp_path / "b")
    shutil.copy(source, tmp_path / "b" / segment_name(int4.fingerprint, slots, 0))
    other = DiskTier(layout, tmp_path / "b", 4 * layout.chunk_nbytes, codec="int4")
    assert len(other) == 0 and other.stats().corrupt_dropped == 2
    assert not other.contains(chunks[0].ref)
    other.close()


@pytest.mark.parametrize("writer", sorted(CODECS))
def test_a_header_of_one_codec_fails_every_other_codecs_checks(
    writer: str, layout: KVLayout
) -> None:
    chunk = make_chunks(layout, 1)[0]
    data = get_codec(writer).encode(chunk.data, layout).numpy().data
    value = rf.encode(layout, chunk.ref, data, get_codec(writer))
    block = bytearray(SlotFormat.for_layout(layout, get_codec(writer)).header_nbytes)
    SlotFormat.for_layout(layout, get_codec(writer)).encode(
        memoryview(block), 0, 0, chunk.key, chunk.ref.token_bytes(), 0
    )
    for reader in CODEC_NAMES:
        same = reader == writer
        status, got = rf.decode(layout, chunk.ref, value, get_codec(reader))
        assert (status == "ok") is same and (got is not None) is same
        head = value[: rf.header_nbytes(chunk.ref)]
        assert rf.names(layout, chunk.ref, head, get_codec(reader)) is same
        key_same = rf.chunk_key("p", layout, chunk.ref, get_codec(reader)) == rf.chunk_key(
            "p", layout, chunk.ref, get_codec(writer)
        )
        assert key_same is same
        fmt = SlotFormat.for_layout(layout, get_codec(reader))
        assert (fmt.decode(memoryview(block)) is not None) is same


def test_a_shared_value_of_another_codec_under_this_codecs_key_is_corrupt_not_decoded(
    redis_cluster: RedisCluster, layout: KVLayout
) -> None:
    from kvtier.tiers.remote import RemoteTier

    prefix = f"t{uuid.uuid4().hex[:10]}"

    def tier(codec: str) -> RemoteTier:
        config = RemoteConfig(
            url=redis_cluster.url, key_prefix=prefix, cluster=True, timeout_s=5.0, codec=codec
        )
        return RemoteTier(layout, config)

    int8, raw = tier("int8"), tier("raw")
    chunk = make_chunks(layout, 1)[0]
    int8.put([chunk])
    out = torch.full(layout.chunk_shape, 7.0)
    assert not raw.contains(chunk.ref) and raw.read(chunk.ref, out) == "missing"
    raw.client.set(raw.key(chunk.ref), int8.client.get(int8.key(chunk.ref)))  # forged
    assert not raw.contains(chunk.ref)
    assert raw.read(chunk.ref, out) == "corrupt" and raw.stats().corrupt_dropped == 1
    assert torch.all(out == 7.0)
    assert int8.read(chunk.ref, out) == "ok"
    int8.close()
    raw.close()


def test_configs_take_every_codec_and_refuse_others(tmp_path: Path) -> None:
    assert list(CODEC_NAMES) == list(CODECS)
    for name in CODEC_NAMES:
        assert DiskConfig(path=str(tmp_path), codec=name).codec == name
    assert DiskConfig(path=str(tmp_path)).codec == "raw"  # exact unless chosen
    with pytest.raises(ValueError, match=r"disk\.codec.*accepted"):
        DiskConfig(path=str(tmp_path), codec="zstd")
    with pytest.raises(ValueError, match=r"remote\.codec"):
        RemoteConfig(url="redis://localhost:1", codec="int2")
