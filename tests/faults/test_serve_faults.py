"""Storage faults seen from a client of ``kvtier serve``: corrupt KV on disk costs recompute,
never a 5xx, the outputs equal the undamaged run's, and ``/metrics`` counts what happened; a
disk tier too small for one chunk is refused at start with one clear line."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import torch
from openai import OpenAI

from kvtier.kv import KVLayout
from kvtier.models import model_config
from kvtier.tiers import DiskTier
from tests.engine.tiny import CHUNK, embedded_tokenizer, save_folder
from tests.server.test_serve_command import free_port, start, stop

pytestmark = pytest.mark.slow

STORY = (
    "Once upon a time, in a village by the sea, there lived an old fisherman who told "
    "stories about the lighthouse, the storms and the ships that never came home. "
)
PROMPTS = [STORY * 3 + f"Chapter {i}." for i in range(3)]


def complete(port: int) -> list[tuple[str, int]]:
    """Each prompt's greedy text and cached tokens (the openai client raises on any 5xx)."""
    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
    out = []
    for prompt in PROMPTS:
        reply = client.completions.create(
            model="tiny",
            prompt=prompt,
            max_tokens=8,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        details = reply.usage.prompt_tokens_details if reply.usage else None
        out.append((reply.choices[0].text, int(details.cached_tokens or 0) if details else 0))
    return out


def metric(port: int, name: str, label: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    found = re.search(rf"^{name}\{{{label}\}} (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


def test_corrupt_disk_kv_is_recomputed_without_a_5xx(tmp_path: Path) -> None:
    tokenizer = embedded_tokenizer()
    folder = tmp_path / "tiny"
    save_folder(folder, tokenizer)
    disk = tmp_path / "kv"
    name = ("--served-model-name", "tiny")
    process = start(folder, disk, free_port(), *name)
    port = int(process.args[process.args.index("--port") + 1])  # type: ignore[union-attr]
    clean = complete(port)
    stop(process)  # SIGTERM: the host tier is written to disk

    # Damage the data (not the headers) of every slot but the first: lookups still find
    # the chunks, and only reading them shows the damage.
    layout = KVLayout.from_model_config(model_config("llama"), torch.float32, CHUNK)
    tier = DiskTier(layout, disk, 32 << 20, fsync=False)
    slot, header = tier.slot_nbytes, tier.header_nbytes
    tier.close()
    (segment,) = sorted(disk.glob("*.kvseg"))
    with open(segment, "r+b") as f:
        for index in range(1, os.path.getsize(segment) // slot):
            f.seek(index * slot + header + 64)
            byte = f.read(1)
            f.seek(index * slot + header + 64)
            f.write(bytes([byte[0] ^ 0xFF]))

    process = start(folder, disk, port := free_port(), *name)
    try:
        damaged = complete(port)
        corrupt = metric(port, "kvtier_tier_corrupt_chunks_total", 'tier="disk"')
        recomputed = metric(port, "kvtier_recomputed_chunks_total", 'cause="corrupt"')
    finally:
        stop(process)
    assert [text for text, _ in damaged] == [text for text, _ in clean]
    assert corrupt > 0 and recomputed > 0
    assert damaged[0][1] < CHUNK * 4  # only the undamaged leading chunk was reused


def test_a_disk_tier_below_one_chunk_is_refused_at_start(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "kvtier.cli", "serve", "--disk-dir", str(tmp_path)]
    command += ["--disk-mb", "1", "--chunk-tokens", "4096", "--port", str(free_port())]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert "Traceback" not in done.stderr, done.stderr
    assert lines[-1].startswith("kvtier: error: ") and "--disk-mb" in lines[-1], done.stderr
