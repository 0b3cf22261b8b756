"""Disk tier specifics: durability across restarts and crashes, corruption, capacity.

Every test runs on two slot geometries: a chunk that moves in one write, and one that moves
in several pieces through the I/O threads (a small ``PIECE_NBYTES`` stands in for the
megabyte pieces of real chunks).
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from kvtier.kv import Chunk, KVLayout
from kvtier.tiers import disk, disk_io
from kvtier.tiers.disk import DiskTier
from tests.conftest import make_chunks, run_in_threads

REPO_ROOT = Path(__file__).resolve().parents[2]
SMALL_PIECE_NBYTES = 8192


@pytest.fixture(params=["one-piece", "pieces"])
def layout(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> KVLayout:
    if request.param == "pieces":
        monkeypatch.setattr(disk, "PIECE_NBYTES", SMALL_PIECE_NBYTES)
        # 34 KiB of data, not a multiple of 4 KiB: five pieces, the last one padded.
        return KVLayout(num_layers=4, num_kv_heads=2, head_dim=16, chunk_tokens=17)
    return KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, chunk_tokens=16)


def open_tier(layout: KVLayout, path: Path, num_slots: int = 16, **kwargs: Any) -> DiskTier:
    return DiskTier(layout, path, num_slots * layout.chunk_nbytes, **kwargs)


def assert_holds_exactly(tier: DiskTier, chunks: list[Chunk]) -> None:
    """``tier`` holds these chunks, bit-exact, and nothing else."""
    assert {ref.key for ref in tier.refs()} == {c.key for c in chunks}
    outs = [tier.layout.empty_chunk() for _ in chunks]
    assert tier.get_into([c.ref for c in chunks], outs) == [True] * len(chunks)
    for chunk, out in zip(chunks, outs, strict=True):
        assert torch.equal(out.view(torch.uint8), chunk.data.view(torch.uint8))


def flip_byte(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


@pytest.mark.parametrize("use_o_direct", [True, False])
def test_round_trip_and_reopen_are_bit_exact(
    layout: KVLayout, tmp_path: Path, use_o_direct: bool
) -> None:
    chunks = make_chunks(layout, 5)
    tier = open_tier(layout, tmp_path, use_o_direct=use_o_direct)
    assert tier.put(chunks).stored == [c.key for c in chunks]
    assert_holds_exactly(tier, chunks)
    tier.close()
    reopened = open_tier(layout, tmp_path, use_o_direct=use_o_direct, verify_on_open=True)
    assert_holds_exactly(reopened, chunks)
    assert reopened.stats().corrupt_dropped == 0
    reopened.close()


def test_segments_grow_lazily_lowest_slot_first(layout: KVLayout, tmp_path: Path) -> None:
    probe = open_tier(layout, tmp_path / "probe")
    tier = open_tier(layout, tmp_path / "tier", segment_nbytes=2 * probe.slot_nbytes)
    assert tier.segment_slots == 2 and not list((tmp_path / "tier").glob("*.kvseg"))
    a, b, c = make_chunks(layout, 3)
    tier.put([a, b])
    assert len(list((tmp_path / "tier").glob("*.kvseg"))) == 1
    tier.remove([a.ref])
    tier.put([c])  # reuses slot 0 rather than opening a second segment
    assert len(list((tmp_path / "tier").glob("*.kvseg"))) == 1
    tier.put([a])
    assert len(list((tmp_path / "tier").glob("*.kvseg"))) == 2
    tier.close()
    # A directory keeps its geometry whatever segment size a later process asks for.
    reopened = open_tier(layout, tmp_path / "tier")
    assert reopened.segment_slots == 2
    assert_holds_exactly(reopened, [a, b, c])
    reopened.close()
    probe.close()


CHILD = """
import sys
sys.path.insert(0, {root!r})
import torch
from tests.conftest import make_chunks
from kvtier.kv import KVLayout
from kvtier.tiers import disk

disk.PIECE_NBYTES = {piece_nbytes}
layout = {layout!r}
tier = disk.DiskTier(layout, {path!r}, 4096 * layout.chunk_nbytes)
for chunk in make_chunks(layout, 2000, seed=11):
    tier.put([chunk])
    print(chunk.key.hex(), flush=True)
"""


def test_chunks_reported_durable_survive_sigkill(layout: KVLayout, tmp_path: Path) -> None:
    script = tmp_path / "child.py"
    source = CHILD.format(
        root=str(REPO_ROOT),
        piece_nbytes=disk.PIECE_NBYTES,
        layout=layout,
        path=str(tmp_path / "kv"),
    )
    script.write_text(source)
    with open(tmp_path / "child.err", "w") as err:
        child = subprocess.Popen(
            [sys.executable, str(script)], stdout=subprocess.PIPE, stderr=err, text=True
        )
        assert child.stdout is not None
        reported = [child.stdout.readline().strip() for _ in range(30)]
        os.kill(child.pid, signal.SIGKILL)  # mid-stream: the child is still putting
        child.wait()
    assert all(reported), (tmp_path / "child.err").read_text()
    assert child.returncode == -signal.SIGKILL

    expected = {c.key.hex(): c for c in make_chunks(layout, 2000, seed=11)}
    tier = open_tier(layout, tmp_path / "kv", num_slots=4096)
    durable = [expected[key] for key in reported]
    outs = [layout.empty_chunk() for _ in durable]
    assert tier.get_into([c.ref for c in durable], outs) == [True] * len(durable)
    for chunk, out in zip(durable, outs, strict=True):
        assert torch.equal(out, chunk.data)
    # Whatever else made it to disk is either exact or refused, never wrong.
    for ref in tier.refs():
        out = layout.empty_chunk()
        if tier.get_into([ref], [out]) == [True]:
            assert torch.equal(out, expected[ref.key.hex()].data)
    tier.close()


def test_flipped_data_byte_is_dropped_on_read(layout: KVLayout, tmp_path: Path) -> None:
    a, b = make_chunks(layout, 2)
    tier = open_tier(layout, tmp_path, fsync=False)
    tier.put([a, b])
    tier.close()
    segment, offset = tier.slot_location(0)  # a went to the lowest slot
    flip_byte(segment, offset + tier.header_nbytes + 100)

    tier = open_tier(layout, tmp_path)  # headers only: the flip is not seen yet
    assert tier.stats().corrupt_dropped == 0
    # (the buffer may hold part of the bad chunk: copies run beside the reads)
    assert tier.get_into([a.ref], [layout.empty_chunk()]) == [False]
    assert tier.stats().corrupt_dropped == 1
    assert_holds_exactly(tier, [b])
    tier.close()
    reopened = open_tier(layout, tmp_path)  # the dropped slot stays dropped
    assert_holds_exactly(reopened, [b])
    reopened.close()


def test_verify_on_open_finds_flipped_data(layout: KVLayout, tmp_path: Path) -> None:
    a, b = make_chunks(layout, 2)
    tier = open_tier(layout, tmp_path, fsync=False)
    tier.put([a, b])
    tier.close()
    segment, offset = tier.slot_location(1)
    flip_byte(segment, offset + tier.header_nbytes + layout.chunk_nbytes - 1)
    reopened = open_tier(layout, tmp_path, verify_on_open=True)
    assert reopened.stats().corrupt_dropped == 1
    assert_holds_exactly(reopened, [a])
    reopened.close()


@pytest.mark.parametrize("field_offset", [0, 30, 300])  # magic, seq, token ids
def test_flipped_header_byte_is_dropped_at_reopen(
    layout: KVLayout, tmp_path: Path, field_offset: int
) -> None:
    a, b, c = make_chunks(layout, 3)
    tier = open_tier(layout, tmp_path, fsync=False)
    tier.put([a, b, c])
    tier.close()
    segment, offset = tier.slot_location(1)
    flip_byte(segment, offset + field_offset)
    reopened = open_tier(layout, tmp_path)
    assert reopened.stats().corrupt_dropped == 1
    assert_holds_exactly(reopened, [a, c])
    reopened.close()


def test_truncated_segment_drops_only_the_cut_slot(layout: KVLayout, tmp_path: Path) -> None:
    chunks = make_chunks(layout, 4)
    tier = open_tier(layout, tmp_path, fsync=False)
    tier.put(chunks[:3])
    tier.close()
    segment, offset = tier.slot_location(2)
    os.truncate(segment, offset + tier.header_nbytes + layout.chunk_nbytes // 2)  # mid-data

    reopened = open_tier(layout, tmp_path)
    assert reopened.stats().corrupt_dropped == 1
    assert_holds_exactly(reopened, chunks[:2])
    reopened.put([chunks[2], chunks[3]])  # the segment is whole again and takes writes
    reopened.close()
    again = open_tier(layout, tmp_path)
    assert again.stats().corrupt_dropped == 0
    assert_holds_exactly(again, chunks)
    again.close()


def test_evicted_chunks_stay_evicted_after_reopen(layout: KVLayout, tmp_path: Path) -> None:
    chunks = make_chunks(layout, 6)
    tier = open_tier(layout, tmp_path, num_slots=3)
    for chunk in chunks:
        tier.put([chunk])
        assert len(tier) <= 3 and tier.used_bytes <= tier.capacity_bytes
    assert tier.stats().evictions == 3
    tier.close()
    # A larger budget would show any header eviction failed to invalidate.
    reopened = open_tier(layout, tmp_path, num_slots=10)
    assert reopened.stats().corrupt_dropped == 0
    assert_holds_exactly(reopened, chunks[3:])
    reopened.close()


def test_reopen_with_smaller_capacity_keeps_the_newest(layout: KVLayout, tmp_path: Path) -> None:
    chunks = make_chunks(layout, 4)
    tier = open_tier(layout, tmp_path, num_slots=4, fsync=False)
    tier.put(chunks)
    tier.close()
    small = open_tier(layout, tmp_path, num_slots=2)
    assert_holds_exactly(small, chunks[2:])
    small.put(chunks[:1])  # evicts the older survivor (LRU order = sequence order)
    assert_holds_exactly(small, [chunks[0], chunks[3]])
    small.close()
    large = open_tier(layout, tmp_path, num_slots=8)
    assert_holds_exactly(large, [chunks[0], chunks[3]])
    large.close()


def test_newest_copy_of_a_key_wins_at_reopen(layout: KVLayout, tmp_path: Path) -> None:
    a, x = make_chunks(layout, 2)
    tier = open_tier(layout, tmp_path, fsync=False)
    tier.put([a])  # slot 0
    segment, offset = tier.slot_location(0)
    tier.sync()
    with open(segment, "rb") as f:
        f.seek(offset)
        stale = f.read(tier.slot_nbytes)
    tier.remove([a.ref])
    tier.put([x, a])  # x in slot 0, a again in slot 1 with a higher sequence number
    tier.close()
    with open(segment, "r+b") as f:  # an old copy of a reappears in slot 0
        f.seek(offset)
        f.write(stale)
    reopened = open_tier(layout, tmp_path)
    assert reopened.stats().corrupt_dropped == 0
    assert_holds_exactly(reopened, [a])
    reopened.put([x])  # the loser's slot 0 was freed and is reused
    assert reopened.slot_location(0) == (segment, offset)
    reopened.close()
    again = open_tier(layout, tmp_path)
    assert_holds_exactly(again, [a, x])
    again.close()


def test_other_layout_in_same_directory_is_ignored(layout: KVLayout, tmp_path: Path) -> None:
    other = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, chunk_tokens=32)
    tier = open_tier(layout, tmp_path, fsync=False)
    tier.put(make_chunks(layout, 2))
    tier.close()
    foreign = open_tier(other, tmp_path)
    assert len(foreign) == 0 and foreign.stats().corrupt_dropped == 0
    foreign.close()


def test_unwritable_path_is_a_value_error(layout: KVLayout, tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    for bad in (blocker, blocker / "sub", Path("/proc/kvtier-test")):
        with pytest.raises(ValueError, match=r"disk\.path: .* not a writable directory"):
            open_tier(layout, bad)


def test_full_disk_disables_writes_and_reads_go_on(
    layout: KVLayout,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    a, b, c = make_chunks(layout, 3)
    tier = open_tier(layout, tmp_path)
    tier.put([a])

    def no_space(fd: int, data: memoryview, offset: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(disk_io, "pwrite_all", no_space)
    with caplog.at_level("ERROR", logger="kvtier.tiers.base"):
        assert tier.put([b, c]).stored == []  # no exception reaches the caller
        tier.put([c])
    monkeypatch.undo()
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1  # logged once
    assert "writes disabled" in errors[0] and "no space left" in errors[0]
    assert ".kvseg" in errors[0]  # names the file
    stats = tier.stats()
    # Two failed writes: b's slot, then erasing its header as the slot was released.
    assert (stats.io_errors, stats.writes_disabled, stats.writes_skipped) == (2, 1, 2)
    assert tier.writes_disabled
    assert_holds_exactly(tier, [a])  # reads go on; the reserved slot was released
    tier.put([b])  # still disabled, even though the disk has room again
    assert_holds_exactly(tier, [a])
    tier.enable_writes()
    tier.put([b])
    assert_holds_exactly(tier, [a, b])
    assert tier.stats().writes_disabled == 0
    tier.close()


def test_failed_flush_disables_writes(
    layout: KVLayout, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b = make_chunks(layout, 2)
    tier = open_tier(layout, tmp_path)

    def io_error(fd: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(disk_io, "datasync", io_error)
    tier.put([a])  # written, but the flush failed: readable, writes now off
    monkeypatch.undo()
    assert tier.writes_disabled and tier.stats().io_errors == 1
    tier.put([b])
    assert_holds_exactly(tier, [a])
    tier.close()


def test_failed_read_is_a_miss(
    layout: KVLayout, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b = make_chunks(layout, 2)
    tier = open_tier(layout, tmp_path)
    tier.put([a, b])

    def io_error(fd: int, buf: memoryview, offset: int) -> int:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(disk_io, "pread_upto", io_error)
    assert tier.get_into([a.ref], [layout.empty_chunk()]) == [False]
    monkeypatch.undo()
    stats = tier.stats()
    assert (stats.io_errors, stats.corrupt_dropped, stats.writes_disabled) == (1, 1, 0)
    assert_holds_exactly(tier, [b])
    tier.close()


def test_capacity_below_one_chunk_is_refused(layout: KVLayout, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"disk\.capacity_bytes \(--disk-mb\): .* at least"):
        DiskTier(layout, tmp_path, layout.chunk_nbytes - 1)
    assert not list(tmp_path.iterdir())  # refused before touching the directory


def test_four_threads_lose_nothing(layout: KVLayout, tmp_path: Path) -> None:
    tier = open_tier(layout, tmp_path, num_slots=64)
    chunk_sets = [make_chunks(layout, 10, seed=200 + t) for t in range(4)]

    def worker(chunks: list[Chunk]) -> None:
        out = layout.empty_chunk()
        for i, chunk in enumerate(chunks):
            tier.put([chunk])
            for earlier in chunks[: i + 1]:
                assert tier.get_into([earlier.ref], [out]) == [True]
                assert torch.equal(out, earlier.data)

    run_in_threads(worker, chunk_sets)
    every = [c for cs in chunk_sets for c in cs]
    assert_holds_exactly(tier, every)
    tier.close()
    reopened = open_tier(layout, tmp_path, num_slots=64, verify_on_open=True)
    assert_holds_exactly(reopened, every)
    reopened.close()


def test_evict_hook_skips_a_corrupt_victim(layout: KVLayout, tmp_path: Path) -> None:
    a, b = make_chunks(layout, 2)
    tier = open_tier(layout, tmp_path, num_slots=1, fsync=False)
    tier.put([a])
    tier.close()
    segment, offset = tier.slot_location(0)
    flip_byte(segment, offset + tier.header_nbytes)
    tier = open_tier(layout, tmp_path, num_slots=1)
    seen: list[Chunk] = []
    tier.set_evict_hook(seen.append)
    tier.put([b])
    assert seen == [] and tier.stats().corrupt_dropped == 1
    assert_holds_exactly(tier, [b])
    tier.close()


def test_second_tier_on_a_directory_is_refused(layout: KVLayout, tmp_path: Path) -> None:
    tier = open_tier(layout, tmp_path)
    with pytest.raises(ValueError, match=r"disk\.path: .* in use by another disk tier"):
        open_tier(layout, tmp_path)
    tier.close()
    open_tier(layout, tmp_path).close()


@pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="no O_DIRECT on this platform")
def test_falls_back_to_buffered_io_without_o_direct(
    layout: KVLayout, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_open = os.open

    def open_without_direct(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if flags & os.O_DIRECT:  # as tmpfs did before Linux 6.6
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", open_without_direct)
    chunks = make_chunks(layout, 3)
    tier = open_tier(layout, tmp_path)
    assert not tier.o_direct
    tier.put(chunks)
    tier.close()
    reopened = open_tier(layout, tmp_path, verify_on_open=True)
    assert_holds_exactly(reopened, chunks)
    reopened.close()


def test_mixed_segment_geometries_are_refused(layout: KVLayout, tmp_path: Path) -> None:
    for slots in (2, 3):
        (tmp_path / f"{layout.fingerprint()}.s{slots}.00000.kvseg").touch()
    with pytest.raises(ValueError, match=r"disk\.path: .* mixes segments of \[2, 3\] slots"):
        open_tier(layout, tmp_path)


def test_reopen_orders_by_sequence_not_slot(layout: KVLayout, tmp_path: Path) -> None:
    a, b, c, d, e = make_chunks(layout, 5)
    tier = open_tier(layout, tmp_path, num_slots=3, fsync=False)
    tier.put([a, b, c])
    tier.remove([a.ref])
    tier.put([d])  # d takes slot 0: slot order d, b, c; write order b, c, d
    tier.close()
    reopened = open_tier(layout, tmp_path, num_slots=3)
    assert reopened.put([e]).evicted == [b.ref]  # the oldest write goes first
    reopened.close()
    small = open_tier(layout, tmp_path, num_slots=2)
    assert_holds_exactly(small, [d, e])
    small.close()
