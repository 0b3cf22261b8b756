"""``kv_connector_extra_config`` onto kvtier's frozen config: ``manager_config``.

The keys a vLLM user sets, with kvtier serve's flag of the same meaning::

    key               flag                default      meaning
    host_mb           --host-mb           4096         host DRAM tier, MiB
    disk_dir          --disk-dir          (none)       a disk tier in this folder
    disk_mb           --disk-mb           32768        its size cap, MiB
    remote            --remote            (none)       redis:// URL of the shared tier
    remote_prefix     --remote-prefix     "kvtier"     key prefix there
    remote_ttl_s      --remote-ttl-s      86400        chunks expire after this (0: never)
    remote_timeout_s  --remote-timeout-s  0.5          a call gives up after this
    remote_mb         --remote-mb         65536        this instance's cap there, MiB
    salt              (tenant salt)       ""           KV is never shared across salts
    write_policy      --write-policy      write_back   write_through: down on seal
    chunk_tokens      --chunk-tokens      256          tokens per chunk (a multiple of
                                                       vLLM's block size)
    host_codec        --host-codec        raw          the host tier's chunk format: raw
                                                       (exact), fp8, int8, int4
    disk_codec        --disk-codec        raw          the disk tier's (as host_codec)
    remote_codec      --remote-codec      raw          the shared tier's (as host_codec)
    eviction_policy   --eviction-policy   lru          host and disk: lru, fifo, s3fifo,
                                                       arc, each also +prefix

An unknown key or a bad value raises ``ValueError`` naming the key and what it accepts.
``for_bursts`` then sizes the host tier's write-back for vLLM's steps. Pure functions.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from kvtier.config import (
    CODEC_NAMES,
    WRITE_POLICIES,
    HostConfig,
    ManagerConfig,
    MiB,
    lower_tiers_of,
)
from kvtier.policy.registry import EVICTION_POLICIES
from kvtier.validate import check_int, check_number

PREFIX = "kv_connector_extra_config"

DEFAULTS: dict[str, Any] = {
    "host_mb": 4096,
    "disk_dir": None,
    "disk_mb": 32768,
    "remote": None,
    "remote_prefix": "kvtier",
    "remote_ttl_s": 24 * 3600.0,
    "remote_timeout_s": 0.5,
    "remote_mb": 65536,
    "salt": "",
    "write_policy": "write_back",
    "chunk_tokens": 256,
    "host_codec": "raw",
    "disk_codec": "raw",
    "remote_codec": "raw",
    "eviction_policy": "lru",
}


def _error(name: str, message: str) -> Exception:
    return ValueError(f"{PREFIX}.{name}: {message}")


def _text(values: Mapping[str, Any], key: str, optional: bool) -> None:
    value = values[key]
    if (value is None and optional) or isinstance(value, str):
        return
    raise _error(key, f"must be a string{' or null' if optional else ''}, got {value!r}")


def manager_config(extra: Mapping[str, Any] | None) -> ManagerConfig:
    """The manager config ``extra`` asks for (``DEFAULTS`` for what it leaves out).

    Raises:
        ValueError: an unknown key or a bad value (one line: ``kv_connector_extra_config.
            KEY: …``).
    """
    unknown = sorted(set(extra or {}) - set(DEFAULTS))
    if unknown:
        raise ValueError(
            f"{PREFIX}: unknown key(s) {', '.join(map(repr, unknown))}; accepted: "
            + ", ".join(DEFAULTS)
        )
    values = {**DEFAULTS, **(extra or {})}
    for key in ("host_mb", "disk_mb", "remote_mb", "chunk_tokens"):
        check_int(key, values[key], 1, error=_error)
    check_number("remote_ttl_s", values["remote_ttl_s"], 0.0, error=_error)
    check_number("remote_timeout_s", values["remote_timeout_s"], 0.001, error=_error)
    for key, optional in (("disk_dir", True), ("remote", True), ("remote_prefix", False)):
        _text(values, key, optional)
    _text(values, "salt", False)
    for key, accepted in (
        ("write_policy", list(WRITE_POLICIES)),
        ("host_codec", list(CODEC_NAMES)),
        ("disk_codec", list(CODEC_NAMES)),
        ("remote_codec", list(CODEC_NAMES)),
        ("eviction_policy", sorted(EVICTION_POLICIES)),
    ):
        if values[key] not in accepted:
            raise _error(key, f"unknown {values[key]!r}; accepted: {accepted}")
    try:
        return ManagerConfig(
            chunk_tokens=values["chunk_tokens"],
            write_policy=values["write_policy"],
            tenant_salt=values["salt"],
            host=HostConfig(
                capacity_bytes=values["host_mb"] * MiB,
                eviction_policy=values["eviction_policy"],
                codec=values["host_codec"],
            ),
            lower_tiers=lower_tiers_of(
                values["disk_dir"],
                values["disk_mb"],
                values["remote"],
                values["remote_prefix"],
                values["remote_ttl_s"],
                values["remote_timeout_s"],
                values["remote_mb"],
                values["disk_codec"],
                values["remote_codec"],
                values["eviction_policy"],
            ),
        )
    except ValueError as exc:  # a tier's own check (e.g. a URL it cannot parse)
        raise ValueError(f"{PREFIX}: {exc}") from None


def for_bursts(config: ManagerConfig, step_tokens: int, chunk_nbytes: int) -> ManagerConfig:
    """``config`` with the hop below host sized for one vLLM step's saves.

    One forward of up to ``step_tokens`` (vLLM's ``max_num_batched_tokens``) completes up
    to ``step_tokens / chunk_tokens`` chunks at once (32 for a 8K step of 256-token
    chunks), and each can evict one chunk from a full host tier. kvtier's own engine seals
    chunks one at a time, so its default queue of 4 is enough there; under vLLM it drops
    most of such a burst, and a dropped chunk is recomputed on its next use. So the write-back
    queue and the link's in-flight bound below host hold one whole step (the queue's
    buffers are allocated at start: ``burst × chunk_nbytes`` of host memory).
    """
    if not config.lower_tiers:
        return config
    burst_chunks = max(4, -(-step_tokens // config.chunk_tokens))
    first = config.lower_tiers[0]
    link = dataclasses.replace(
        first.link,
        max_inflight_bytes=max(first.link.max_inflight_bytes, burst_chunks * chunk_nbytes),
    )
    first = dataclasses.replace(
        first, write_queue_chunks=max(first.write_queue_chunks, burst_chunks), link=link
    )
    return dataclasses.replace(config, lower_tiers=(first, *config.lower_tiers[1:]))
