"""Storage faults degrade, never fail a request (issue 8, item 4).

Each test damages the real disk tier under a real engine (the tiny random-weight model)
and checks three things: every request finishes with the tokens of a fault-free run, no
exception reaches it, and the fault shows in the counters.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kvbench import mounts
from kvtier.config import DiskConfig
from kvtier.engine import Engine, EngineConfig, SamplingParams
from kvtier.kv import KVLayout
from kvtier.models import model_config
from kvtier.tiers import DiskTier
from tests.engine.tiny import CHUNK, engine_config

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
STORY = (
    "Once upon a time, in a village by the sea, there lived an old fisherman who told "
    "stories about the lighthouse, the storms and the ships that never came home. "
)
PROMPTS = [STORY * 4 + f"Chapter {i}." for i in range(3)]


def run(engine: Engine, prompts: list[str]) -> list[Any]:
    """Submit every prompt at once; the results, in order (raises if any request failed)."""
    handles = [engine.submit(p, GREEDY) for p in prompts]
    return [h.result() for h in handles]


@pytest.fixture(scope="module")
def expected(model: Any, tokenizer: Any) -> list[list[int]]:
    """The tokens of a fault-free run without any disk."""
    with Engine(model, tokenizer, engine_config()) as engine:
        return [r.token_ids for r in run(engine, PROMPTS)]


def with_policy(config: EngineConfig, write_policy: str) -> EngineConfig:
    return dataclasses.replace(
        config, manager=dataclasses.replace(config.manager, write_policy=write_policy)
    )


def fill_disk(model: Any, tokenizer: Any, disk: Path) -> None:
    """A first engine serves the prompts and leaves their KV on disk when it closes."""
    engine = Engine(model, tokenizer, engine_config(disk_dir=str(disk)))
    run(engine, PROMPTS)
    engine.close(drain=True)


def segments(disk: Path) -> list[Path]:
    found = sorted(disk.glob("*.kvseg"))
    assert found, f"no segment files in {disk}"
    return found


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def disk_tier(engine: Engine) -> DiskTier:
    assert isinstance(engine.manager.disk, DiskTier)
    return engine.manager.disk


def test_flipped_bytes_are_recomputed(
    model: Any, tokenizer: Any, expected: list[list[int]], tmp_path: Path
) -> None:
    disk = tmp_path / "kv"
    fill_disk(model, tokenizer, disk)
    with Engine(model, tokenizer, engine_config(disk_dir=str(disk))) as engine:
        tier = disk_tier(engine)
        (segment,) = segments(disk)
        # Damage the data (not the header) of every slot after the first two: the headers
        # still name the chunks, so lookups find them and only the read sees the damage.
        for slot in range(2, os.path.getsize(segment) // tier.slot_nbytes):
            flip_byte(segment, slot * tier.slot_nbytes + tier.header_nbytes + 100)
        results = run(engine, PROMPTS)
        stats = engine.manager.stats()
    assert [r.token_ids for r in results] == expected
    assert stats.tiers["disk"].corrupt_dropped > 0
    assert stats.recomputed_chunks_by_cause["corrupt"] > 0
    assert 0 < results[0].reused_tokens < CHUNK * ((len(results[0].prompt_ids) - 1) // CHUNK)


def test_segment_truncated_while_serving_is_recomputed(
    model: Any, tokenizer: Any, expected: list[list[int]], tmp_path: Path
) -> None:
    disk = tmp_path / "kv"
    fill_disk(model, tokenizer, disk)
    with Engine(model, tokenizer, engine_config(disk_dir=str(disk))) as engine:
        tier = disk_tier(engine)
        (segment,) = segments(disk)
        assert len(tier) > 4
        os.truncate(segment, 3 * tier.slot_nbytes + tier.header_nbytes + 10)  # mid-slot 3
        results = run(engine, PROMPTS)
        stats = engine.manager.stats()
    assert [r.token_ids for r in results] == expected
    assert stats.tiers["disk"].corrupt_dropped > 0
    assert sum(stats.recomputed_chunks_by_cause.values()) > 0


def test_truncated_segment_found_at_restart(
    model: Any, tokenizer: Any, expected: list[list[int]], tmp_path: Path
) -> None:
    disk = tmp_path / "kv"
    fill_disk(model, tokenizer, disk)
    (segment,) = segments(disk)
    os.truncate(segment, os.path.getsize(segment) // 2)
    with Engine(model, tokenizer, engine_config(disk_dir=str(disk))) as engine:
        assert engine.manager.stats().tiers["disk"].corrupt_dropped >= 1  # found by the scan
        results = run(engine, PROMPTS)
    assert [r.token_ids for r in results] == expected


@contextlib.contextmanager
def tiny_tmpfs(path: Path, size_kib: int) -> Iterator[Path]:
    """A real ``size_kib`` tmpfs mounted at ``path``; skips where mounting is not allowed."""
    try:
        with mounts.tmpfs(path, size_kib) as mounted:
            yield mounted
    except mounts.MountRefused as exc:
        pytest.skip(str(exc))


@pytest.mark.parametrize("write_policy", ["write_through", "write_back"])
def test_full_filesystem_stops_disk_writes_and_serving_goes_on(
    model: Any,
    tokenizer: Any,
    expected: list[list[int]],
    tmp_path: Path,
    write_policy: str,
) -> None:
    with tiny_tmpfs(tmp_path / "small", size_kib=64) as disk:  # room for ~5 of the slots
        # A host of 12 chunks evicts (write-back goes to disk) while every prompt fits.
        config = with_policy(engine_config(disk_dir=str(disk), host_chunks=12), write_policy)
        engine = Engine(model, tokenizer, config)
        results = run(engine, PROMPTS)
        again = run(engine, PROMPTS)  # with the disk off, host still serves reuse
        engine.close(drain=True)  # writing host to disk at close does not raise either
        manager = engine.manager.stats()
        assert disk_tier(engine).writes_disabled
    assert [r.token_ids for r in results] == expected
    assert [r.token_ids for r in again] == expected
    stats = manager.tiers["disk"]
    assert stats.io_errors >= 1 and stats.writes_disabled == 1
    assert stats.puts > 0  # it took writes until the filesystem was full
    # What came after was not written: dropped from the write-through queue, or skipped.
    assert (
        manager.write_through_dropped if write_policy == "write_through" else stats.writes_skipped
    ) > 0


def test_a_read_only_disk_folder_serves_what_it_holds_and_says_so_once(
    model: Any,
    tokenizer: Any,
    expected: list[list[int]],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The folder's filesystem is mounted read-only after a run left KV in it (EROFS from
    the kernel; root ignores file modes, not a read-only mount). The engine starts on it,
    serves the chunks it holds from disk, keeps new KV in host, and says so in one line."""
    with tiny_tmpfs(tmp_path / "ro", size_kib=8192) as disk:
        config = with_policy(engine_config(disk_dir=str(disk)), "write_through")
        with Engine(model, tokenizer, config) as engine:
            run(engine, PROMPTS[:1])
        mounts.remount_read_only(disk)  # a tmpfs was mounted: remounting it is allowed
        caplog.set_level(logging.WARNING, logger="kvtier")
        with Engine(model, tokenizer, config) as engine:
            results = run(engine, PROMPTS)
            stats = engine.manager.stats().tiers["disk"]
    assert [r.token_ids for r in results] == expected
    assert results[0].reused_tokens > 0  # the first prompt's KV came back from disk
    assert stats.hits > 0 and stats.puts == 0 and stats.writes_disabled == 1
    lines = [r.getMessage() for r in caplog.records if "takes no writes" in r.getMessage()]
    assert len(lines) == 1 and str(disk) in lines[0] and "Read-only file system" in lines[0]


def test_device_that_refuses_every_write(
    model: Any, tokenizer: Any, expected: list[list[int]], tmp_path: Path
) -> None:
    """The segment file is /dev/full: opening it for direct I/O fails with EINVAL and
    writing to it with ENOSPC, both real errors from the kernel."""
    disk = tmp_path / "kv"
    config = with_policy(engine_config(disk_dir=str(disk)), "write_through")
    with Engine(model, tokenizer, config) as engine:
        segment, _ = disk_tier(engine).slot_location(0)
        os.symlink("/dev/full", segment)  # before the first write opens it
        results = run(engine, PROMPTS)
        stats = engine.manager.stats()
    assert [r.token_ids for r in results] == expected
    disk_stats = stats.tiers["disk"]
    assert disk_stats.io_errors >= 1 and disk_stats.writes_disabled == 1
    assert disk_stats.puts == 0
    assert stats.write_through_dropped > 0


def test_disk_smaller_than_a_chunk_is_refused_at_start(model: Any, tokenizer: Any) -> None:
    layout = KVLayout.from_model_config(model_config("llama"), torch.float32, CHUNK)
    config = engine_config(disk_dir="unused")
    small = DiskConfig(path="unused", capacity_bytes=layout.chunk_nbytes - 1)
    manager = dataclasses.replace(config.manager, lower_tiers=(small,))
    config = dataclasses.replace(config, manager=manager)
    with pytest.raises(ValueError, match=r"disk\.capacity_bytes \(--disk-mb\)") as caught:
        Engine(model, tokenizer, config)
    assert f"at least {layout.chunk_nbytes} bytes" in str(caught.value)
    assert not os.path.exists("unused")
