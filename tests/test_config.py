from __future__ import annotations

import pytest

from kvtier.config import DeviceConfig, DiskConfig, HostConfig, LinkConfig, ManagerConfig


@pytest.mark.parametrize(
    ("build", "pattern"),
    [
        (lambda: DeviceConfig(budget_bytes=-1), r"device\.budget_bytes.*>= 0"),
        (lambda: HostConfig(capacity_bytes=-5), r"host\.capacity_bytes.*>= 0"),
        (lambda: DiskConfig(path="/x", capacity_bytes=-1), r"disk\.capacity_bytes"),
        (lambda: HostConfig(eviction_policy="mru"), r"host\.eviction_policy.*accepted.*lru"),
        (lambda: LinkConfig(gbps=0.0), r"link\.gbps.*> 0"),
        (lambda: LinkConfig(latency_ms=-1.0), r"link\.latency_ms"),
        (lambda: ManagerConfig(write_policy="sometimes"), r"write_policy.*write_through"),
        (lambda: ManagerConfig(chunk_tokens=0), r"chunk_tokens.*>= 1"),
        (lambda: DiskConfig(path="  "), r"disk\.path"),
    ],
)
def test_bad_configuration_names_field_and_accepted_values(build: object, pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        build()  # type: ignore[operator]


def test_defaults_are_valid() -> None:
    config = ManagerConfig()
    assert config.write_policy == "write_back" and config.disk.path is None
