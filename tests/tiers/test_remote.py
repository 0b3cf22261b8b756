"""The shared tier against a real Redis: corrupt and truncated values, a store that is
down or slow (bounded waits, one log line, recovery), write-behind, plain Redis, ACL.

The contract tests (``test_contract.py``) run over it on the session's Redis Cluster too.
"""

from __future__ import annotations

import logging
import time
import uuid
from pathlib import Path

import pytest
import redis
import torch

from kvbench.redis_cluster import RedisCluster, available, free_ports
from kvtier.config import DiskConfig, HostConfig, ManagerConfig, RemoteConfig
from kvtier.kv import Chunk, KVLayout
from kvtier.manager import KVManager
from kvtier.tiers import host_tier, remote_format
from kvtier.tiers.pool import PoolTier
from kvtier.tiers.remote import RemoteTier
from tests.conftest import make_chunks

pytestmark = pytest.mark.skipif(available() is not None, reason=f"no Redis: {available()}")


def _prefix() -> str:
    return f"test{uuid.uuid4().hex[:12]}"


def _tier(layout: KVLayout, url: str, cluster: bool = True, **changes: object) -> RemoteTier:
    """A tier on its own prefix; a 5 s timeout unless the test is about timeouts (a loaded
    machine can take over 0.5 s to answer)."""
    changes.setdefault("timeout_s", 5.0)
    config = RemoteConfig(url=url, key_prefix=_prefix(), cluster=cluster, **changes)  # type: ignore[arg-type]
    return RemoteTier(layout, config)


def _host_holding(layout: KVLayout, count: int) -> tuple[PoolTier, list[Chunk]]:
    """A host tier holding ``count`` new chunks (a write-behind's source)."""
    host = host_tier(layout, count * layout.chunk_nbytes, pin_memory=False)
    chunks = make_chunks(layout, count)
    host.put(chunks)
    return host, chunks


def test_corrupt_and_truncated_values_are_dropped_and_never_served(
    redis_cluster: RedisCluster, layout: KVLayout
) -> None:
    tier = _tier(layout, redis_cluster.url)
    a, b, c, d = make_chunks(layout, 4)
    tier.put([a, b, c, d])
    raw = tier.client.get(tier.key(a))
    flipped = bytearray(raw)
    flipped[len(raw) // 2] ^= 0x40
    tier.client.set(tier.key(a), bytes(flipped))  # a bit flipped in the data
    tier.client.set(tier.key(b), raw[: len(raw) - 100])  # truncated
    tier.client.append(tier.key(d), b"trailing")  # longer than a value is
    outs = [torch.full(layout.chunk_shape, 5.0) for _ in range(4)]
    assert tier.get_into([a.ref, b.ref, c.ref, d.ref], outs) == [False, False, True, False]
    assert torch.all(outs[0] == 5.0) and torch.all(outs[1] == 5.0) and torch.all(outs[3] == 5.0)
    assert torch.equal(outs[2], c.data)
    assert tier.stats().corrupt_dropped == 3
    assert tier.client.exists(tier.key(a), tier.key(b), tier.key(d)) == 0  # deleted
    tier.client.set(tier.key(c), raw)  # a's intact value under c's key: another chunk's
    assert tier.read(c.ref, outs[2]) == "missing" and tier.stats().collisions == 1
    tier.client.set(tier.key(a), bytes(flipped))
    assert tier.read(a.ref, outs[0]) == "corrupt" and tier.stats().corrupt_dropped == 4
    tier.close()


def test_the_size_cap_deletes_this_instances_least_recently_used_values(
    redis_cluster: RedisCluster, layout: KVLayout
) -> None:
    chunks = make_chunks(layout, 4)
    value_nbytes = len(
        remote_format.encode(
            layout, chunks[0].ref, chunks[0].data.view(torch.uint8).reshape(-1).numpy().data
        )
    )
    tier = _tier(layout, redis_cluster.url, capacity_bytes=3 * value_nbytes)
    a, b, c, d = chunks
    tier.put([a, b, c])
    assert tier.used_bytes == 3 * value_nbytes
    out = torch.empty(layout.chunk_shape)
    assert tier.get_into([a.ref], [out]) == [True]  # a is now the most recently used
    tier.put([d])  # over the cap: b, the least recently used, goes
    assert [tier.client.exists(tier.key(x.ref)) for x in chunks] == [1, 0, 1, 1]
    assert tier.used_bytes == 3 * value_nbytes and tier.stats().evictions == 1
    other = RemoteTier(layout, tier.config)  # another instance: its share starts empty
    assert other.used_bytes == 0 and other.contains(c.ref)
    tier.remove([a.ref, c.ref])
    assert tier.used_bytes == value_nbytes
    tier.clear()
    assert tier.used_bytes == 0 and len(other) == 0
    other.close()
    tier.close()


def test_a_cap_below_one_chunk_is_refused_in_one_line(layout: KVLayout) -> None:
    config = RemoteConfig(url="redis://127.0.0.1:1", capacity_bytes=layout.chunk_nbytes - 1)
    with pytest.raises(ValueError, match="holds no chunk") as caught:
        RemoteTier(layout, config)
    assert "--remote-mb" in str(caught.value) and "\n" not in str(caught.value)


def test_a_store_that_is_down_costs_one_timeout_then_nothing_and_recovers(
    layout: KVLayout, caplog: pytest.LogCaptureFixture
) -> None:
    port = free_ports(1)[0]
    config = RemoteConfig(
        url=f"redis://127.0.0.1:{port}", key_prefix=_prefix(), cluster=False,
        timeout_s=0.3, retry_after_s=0.5,
    )  # fmt: skip
    tier = RemoteTier(layout, config)
    (chunk,) = make_chunks(layout, 1)
    with caplog.at_level(logging.WARNING, logger="kvtier.tiers.remote"):
        start = time.perf_counter()
        assert not tier.contains(chunk.ref)  # refused: one failed call
        for _ in range(50):  # inside the back-off: no call at all
            assert not tier.contains(chunk.ref)
            assert tier.get_into([chunk.ref], [layout.empty_chunk()]) == [False]
        assert time.perf_counter() - start < config.timeout_s + 0.2
        assert tier.put([chunk]).stored == []
        assert not tier.available
        down = [r for r in caplog.records if "recomputed until it answers" in r.message]
        assert len(down) == 1  # one line for the outage, not one per call
        server = RedisCluster.start_single(port=port)
        try:
            time.sleep(config.retry_after_s)
            assert tier.put([chunk]).stored == [chunk.key]
            assert tier.contains(chunk.ref) and tier.available
            assert any("answering again" in r.message for r in caplog.records)
        finally:
            tier.close()
            server.stop()
    stats = tier.stats()
    assert stats.io_errors >= 1 and stats.writes_skipped == 1


def test_a_slow_store_gives_up_after_the_timeout(layout: KVLayout) -> None:
    server = RedisCluster.start_single()
    try:
        tier = _tier(layout, server.url, cluster=False, timeout_s=0.3, retry_after_s=1.0)
        chunks = make_chunks(layout, 4)
        chunk = chunks[0]
        tier.put(chunks)
        slow = redis.Redis.from_url(server.url)
        slow.execute_command("CLIENT", "PAUSE", "1500", "ALL")  # the store stops answering
        start = time.perf_counter()
        tier.read_ahead([c.ref for c in chunks])  # reads ahead wait on it too
        outs = [layout.empty_chunk() for _ in chunks]
        assert tier.get_into([c.ref for c in chunks], outs) == [False] * 4
        assert time.perf_counter() - start < 0.3 + 0.2  # one timeout, not one per read
        time.sleep(1.6)  # the pause ends; the back-off has passed
        out = layout.empty_chunk()
        assert tier.get_into([chunk.ref], [out]) == [True] and torch.equal(out, chunk.data)
        tier.close()
        slow.close()
    finally:
        server.stop()


def test_write_behind_reads_from_host_and_drops_the_oldest_when_full(
    redis_cluster: RedisCluster, layout: KVLayout
) -> None:
    host, chunks = _host_holding(layout, 6)
    tier = _tier(layout, redis_cluster.url, write_behind_chunks=64)
    tier.write_behind([c.ref for c in chunks], host)
    tier.sync()
    assert all(tier.contains(c.ref) for c in chunks)
    out = layout.empty_chunk()
    assert tier.get_into([chunks[4].ref], [out]) == [True] and torch.equal(out, chunks[4].data)
    tier.close()
    # A queue of 2 behind a store that does not answer: the oldest waiting refs go.
    port = free_ports(1)[0]
    dead = _tier(layout, f"redis://127.0.0.1:{port}", cluster=False, write_behind_chunks=2)
    dead.write_behind([c.ref for c in chunks], host)
    dead.sync()
    stats = dead.stats()
    assert stats.writes_dropped >= 6 - 2 - 1  # the writer may have taken one batch first
    assert stats.writes_dropped + stats.writes_skipped == 6
    dead.close()
    host.close()


def test_a_burst_that_overruns_host_still_reaches_the_store_past_the_disk(
    redis_cluster: RedisCluster, layout: KVLayout, tmp_path: Path
) -> None:
    """Eight chunks stored at once into a host tier of two, with a disk between host and
    the store: six leave host (written back to disk; the queue holds them all) before the
    store's writer reads them. It reads those from where they went (the write-back queue
    or the disk), so every one reaches the store."""
    config = ManagerConfig(
        chunk_tokens=layout.chunk_tokens,
        host=HostConfig(capacity_bytes=2 * layout.chunk_nbytes),
        lower_tiers=(
            DiskConfig(
                path=str(tmp_path), capacity_bytes=64 * layout.chunk_nbytes, write_queue_chunks=8
            ),
            RemoteConfig(url=redis_cluster.url, key_prefix=_prefix(), timeout_s=5.0),
        ),
    )
    chunks = make_chunks(layout, 8)
    with KVManager(layout, "test-model", config) as manager:
        manager.store(chunks)
        manager.wait_writes()
        store = manager.tier("remote")
        store.sync()
        assert [store.contains(c.ref) for c in chunks] == [True] * 8
        assert store.stats().writes_dropped == 0
        out = layout.empty_chunk()
        assert store.get_into([chunks[0].ref], [out]) == [True]
        assert torch.equal(out, chunks[0].data)


def test_chunks_of_a_real_model_reach_the_store_within_the_default_timeout(
    redis_cluster: RedisCluster,
) -> None:
    """The embedded model's 256-token chunks are 11.3 MiB each. The writer sends at most
    16 MiB a call, so eight of them at once are eight calls, each well within the default
    0.5 s timeout (one call of all eight, 90 MiB, took over 0.5 s on a loaded machine: the
    tier went down and its writes were skipped)."""
    layout = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64)  # SmolLM2-135M's
    chunks = make_chunks(layout, 8)
    host = host_tier(layout, 8 * layout.chunk_nbytes, pin_memory=False)
    host.put(chunks)
    tier = RemoteTier(layout, RemoteConfig(url=redis_cluster.url, key_prefix=_prefix()))
    tier.write_behind([c.ref for c in chunks], host)
    tier.sync()
    stats = tier.stats()
    assert (stats.io_errors, stats.writes_skipped, stats.writes_dropped) == (0, 0, 0)
    assert [tier.contains(c.ref) for c in chunks] == [True] * 8
    tier.close()
    host.close()


def test_write_behind_sends_nothing_the_store_holds_and_renews_its_ttl(
    redis_cluster: RedisCluster, layout: KVLayout
) -> None:
    host, chunks = _host_holding(layout, 3)
    a = _tier(layout, redis_cluster.url, ttl_s=100.0)
    a.put(chunks[:2])
    a.client.pexpire(a.key(chunks[0].ref), 5000)  # about to expire
    b = RemoteTier(layout, a.config)  # another instance on the same keys
    b.write_behind([c.ref for c in chunks], host)
    b.sync()
    stats = b.stats()
    assert stats.duplicate_puts == 2 and stats.puts == 1  # only the one it lacked
    assert b.used_bytes == remote_format.value_nbytes(layout, chunks[2].ref)
    assert a.client.pttl(a.key(chunks[0].ref)) > 50_000  # renewed: it is in use
    assert b.put(chunks).already_present == [c.key for c in chunks]
    for tier in (a, b):
        tier.close()
    host.close()


def test_plain_redis_with_one_url_and_auth(layout: KVLayout) -> None:
    server = RedisCluster.start_single(password="s3cret")
    try:
        chunks = make_chunks(layout, 2)
        tier = RemoteTier(layout, RemoteConfig(url=server.url, key_prefix=_prefix()))  # asks
        tier.put(chunks)
        out = layout.empty_chunk()
        assert tier.get_into([chunks[1].ref], [out]) == [True] and torch.equal(out, chunks[1].data)
        tier.close()
        refused = RemoteTier(layout, RemoteConfig(url=f"redis://127.0.0.1:{server.ports[0]}"))
        assert not refused.available  # no password: refused, so the tier is down
        assert refused.stats().io_errors == 1 and not refused.contains(chunks[0].ref)
        refused.close()
    finally:
        server.stop()


def test_an_acl_user_sees_only_its_key_prefix(
    redis_cluster: RedisCluster, layout: KVLayout
) -> None:
    prefix = _prefix()
    for port in redis_cluster.ports:
        redis_cluster.cli(
            port, "ACL", "SETUSER", prefix, "on", ">pw", f"~{prefix}:*", "&*", "+@all"
        )
    host, port = "127.0.0.1", redis_cluster.ports[0]
    admin = redis.cluster.RedisCluster(host=host, port=port)
    admin.set("someone-else:key", b"secret")
    url = f"redis://{prefix}:pw@{host}:{port}"
    tier = RemoteTier(layout, RemoteConfig(url=url, key_prefix=prefix, cluster=True))
    chunks = make_chunks(layout, 2)
    tier.put(chunks)
    assert all(tier.contains(c.ref) for c in chunks) and len(tier) == 2
    with pytest.raises(redis.exceptions.NoPermissionError):
        tier.client.get("someone-else:key")
    tier.close()
    admin.close()


def test_calibrate_measures_the_shared_tier_and_leaves_nothing(
    redis_cluster: RedisCluster, layout: KVLayout
) -> None:
    from kvtier.calibrate import measure_remote

    rates = measure_remote(redis_cluster.url, layout, 8 * layout.chunk_nbytes, 1)
    assert rates["write_gbps"] > 0 and rates["read_gbps"] > 0
    assert rates["url"] == redis_cluster.url  # no credentials in it
    client = redis.cluster.RedisCluster(host="127.0.0.1", port=redis_cluster.ports[0])
    assert not list(client.scan_iter(match="kvtier-calibrate-*"))
    client.close()


def test_a_url_may_name_several_nodes_and_logs_show_no_credentials() -> None:
    from kvtier.tiers.remote_client import node_urls, safe_url

    url = "rediss://kv:s3cret@10.0.0.1:7000,10.0.0.2:7001/0"
    assert node_urls(url) == [
        "rediss://kv:s3cret@10.0.0.1:7000/0",
        "rediss://kv:s3cret@10.0.0.2:7001/0",
    ]
    assert safe_url(url) == "rediss://10.0.0.1:7000,10.0.0.2:7001"
    assert node_urls("redis://h:1") == ["redis://h:1"]
