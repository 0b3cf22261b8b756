"""``read_value`` against a real Redis: values read off the socket bit-exact whatever their
length, the pooled connection left clean, a stale slot map (``MOVED``) followed through
redis-py, an error reply raised, AUTH on a plain server."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import numpy as np
import pytest
import redis
from redis.cluster import RedisCluster as ClusterClient

from kvbench.redis_cluster import RedisCluster, available
from kvtier.tiers.remote_wire import READ_PIECE_NBYTES, ReadBuffers, read_value

pytestmark = pytest.mark.skipif(available() is not None, reason=f"no Redis: {available()}")

SIZES = [1, 1000, READ_PIECE_NBYTES - 1, READ_PIECE_NBYTES, READ_PIECE_NBYTES + 1, 3_500_001]


@pytest.fixture
def client(redis_cluster: RedisCluster) -> Iterator[ClusterClient]:
    made = ClusterClient(host="127.0.0.1", port=redis_cluster.ports[0])
    yield made
    made.close()


def _key() -> str:
    return f"wire{uuid.uuid4().hex[:12]}"


def _read(client: object, key: str, nbytes: int) -> bytes:
    buffer = ReadBuffers().take(nbytes + 1)
    filled = read_value(client, key, nbytes, buffer)
    return bytes(buffer[:filled])


@pytest.mark.parametrize("nbytes", SIZES)
def test_a_value_of_any_length_reads_bit_exact(client: ClusterClient, nbytes: int) -> None:
    key, value = _key(), os.urandom(nbytes)
    client.set(key, value)
    assert _read(client, key, nbytes) == value
    # The pooled connection is clean: the next command on that node reads its own reply.
    assert client.get(key) == value
    assert _read(client, key, nbytes) == value


def test_missing_longer_and_shorter_values_read_as_what_the_store_holds(
    client: ClusterClient,
) -> None:
    key = _key()
    assert _read(client, key, 5000) == b""  # no such key
    value = os.urandom(READ_PIECE_NBYTES + 10)
    client.set(key, value)
    assert _read(client, key, len(value) - 1) == value  # one byte past is asked for
    assert _read(client, key, len(value) + 99) == value  # shorter: reads shorter
    assert _read(client, key, len(value) - 10) == value[: len(value) - 9]


def test_a_stale_slot_map_is_followed_through_redis_py(client: ClusterClient) -> None:
    key, value = _key(), os.urandom(2 * READ_PIECE_NBYTES + 7)
    client.set(key, value)
    slot = client.keyslot(key)
    owner = client.get_node_from_key(key)
    other = next(n for n in client.get_primaries() if n.name != owner.name)
    client.nodes_manager.slots_cache[slot] = [other]  # as after a failover: MOVED
    assert _read(client, key, len(value)) == value
    assert client.get_node_from_key(key).name == owner.name  # the map was refreshed


def test_an_error_reply_is_raised_and_the_connection_is_not_reused(
    client: ClusterClient,
) -> None:
    wrong = _key()
    client.rpush(wrong, b"a list, not a string")
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        _read(client, wrong, 100)
    key, value = f"{{{wrong}}}:ok", os.urandom(4096)  # the same slot, so the same pool
    client.set(key, value)
    assert _read(client, key, len(value)) == value


def test_plain_redis_with_auth_reads_through_its_own_handshake() -> None:
    server = RedisCluster.start_single(password="s3cret")
    try:
        plain = redis.Redis.from_url(server.url)
        key, value = _key(), os.urandom(READ_PIECE_NBYTES * 2)
        plain.set(key, value)
        assert _read(plain, key, len(value)) == value
        plain.close()
    finally:
        server.stop()


def test_a_buffer_too_small_is_refused(client: ClusterClient) -> None:
    with pytest.raises(ValueError, match="buffer"):
        read_value(client, _key(), 10, np.empty(10, np.uint8))


def test_buffers_are_reused_and_cut_to_the_size_asked() -> None:
    buffers = ReadBuffers(keep=1)
    buffers.reserve(100, 3)  # only `keep` are kept
    first = buffers.take(100)
    assert first.nbytes == 100 and np.all(first == 0)
    buffers.give(first)
    part = buffers.take(40)  # a smaller read (a partial chunk) reuses it, cut to 40
    assert part.nbytes == 40 and part.base is first.base
    assert buffers.take(40) is not part  # lent out: a new one
    buffers.give(part)
    assert buffers.take(100).nbytes == 100  # the whole buffer came back
    assert buffers.take(200).nbytes == 200  # larger than any idle one: a new one
