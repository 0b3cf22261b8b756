from __future__ import annotations

import pytest

from kvtier.config import DiskConfig, HostConfig, LinkConfig, ManagerConfig


@pytest.mark.parametrize(
    ("build", "pattern"),
    [
        (lambda: HostConfig(capacity_bytes=-5), r"host\.capacity_bytes.*>= 0"),
        (lambda: DiskConfig(path="/x", capacity_bytes=-1), r"disk\.capacity_bytes"),
        (lambda: DiskConfig(path="/x", write_queue_chunks=-1), r"disk\.write_queue_chunks"),
        (lambda: HostConfig(eviction_policy="mru"), r"host\.eviction_policy.*accepted.*lru"),
        (lambda: DiskConfig(path="/x", eviction_policy="mru"), r"disk\.eviction_policy"),
        (lambda: LinkConfig(gbps=0.0), r"link\.gbps.*> 0"),
        (lambda: LinkConfig(latency_ms=-1.0), r"link\.latency_ms"),
        (lambda: ManagerConfig(write_policy="sometimes"), r"write_policy.*write_through"),
        (lambda: ManagerConfig(chunk_tokens=0), r"chunk_tokens.*>= 1"),
        (lambda: DiskConfig(path="  "), r"disk\.path"),
        (lambda: ManagerConfig(lower_tiers=(HostConfig(),)), r"lower_tiers\[0\].*below host"),
        (
            lambda: ManagerConfig(lower_tiers=(DiskConfig(path="/a"), DiskConfig(path="/b"))),
            r"lower_tiers\[1\]\.kind.*'disk'.*twice",
        ),
    ],
)
def test_bad_configuration_names_field_and_accepted_values(build: object, pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        build()  # type: ignore[operator]


def test_defaults_are_valid() -> None:
    config = ManagerConfig()
    assert config.write_policy == "write_back" and config.lower_tiers == ()
    assert [t.kind for t in config.tiers] == ["host"]


def test_stack_is_host_then_lower_tiers_in_order() -> None:
    disk = DiskConfig(path="/kv", link=LinkConfig(gbps=1.0))
    config = ManagerConfig(host=HostConfig(capacity_bytes=1), lower_tiers=[disk])  # type: ignore[arg-type]
    assert config.lower_tiers == (disk,)  # a list is kept as a tuple (hashable, frozen)
    assert config.tiers == (config.host, disk)
    assert config.lower_tier("disk") is disk and config.lower_tier("remote") is None


def test_remote_config_rejects_bad_fields() -> None:
    from kvtier.config import RemoteConfig

    with pytest.raises(ValueError, match=r"remote\.url"):
        RemoteConfig(url="http://host:6379")
    with pytest.raises(ValueError, match=r"remote\.key_prefix"):
        RemoteConfig(url="redis://h:1", key_prefix="a:b")
    with pytest.raises(ValueError, match=r"remote\.timeout_s"):
        RemoteConfig(url="redis://h:1", timeout_s=0)
    with pytest.raises(ValueError, match=r"remote\.ttl_s"):
        RemoteConfig(url="redis://h:1", ttl_s=0.0)
    with pytest.raises(ValueError, match=r"remote\.write_behind_chunks"):
        RemoteConfig(url="redis://h:1", write_behind_chunks=0)
