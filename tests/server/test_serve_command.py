"""``kvtier serve`` as a process: SIGTERM drains in-flight streams and flushes the host tier
to disk, so an engine restarted on the same disk directory reuses that KV."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from openai import OpenAI

from kvtier.engine import Engine, SamplingParams
from tests.engine.tiny import embedded_tokenizer, engine_config, save_folder

pytestmark = pytest.mark.slow

PROMPT = (
    "Once upon a time, in a village by the sea, there lived an old fisherman who told "
    "stories about the lighthouse."
)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start(
    folder: Path, disk: Path, port: int, *extra: str, env: dict[str, str] | None = None
) -> subprocess.Popen[str]:
    """``kvtier serve`` on the tiny model folder, with ``extra`` flags; waits for /health."""
    command = [sys.executable, "-m", "kvtier.cli", "serve", "--model", str(folder)]
    command += ["--port", str(port), "--disk-dir", str(disk), "--chunk-tokens", "16"]
    command += ["--device-budget-mb", "1", "--host-mb", "16", "--log-level", "warning", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    process = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as reply:
                if reply.status == 200:
                    return process
        except (urllib.error.URLError, ConnectionError):
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"kvtier serve did not start: {process.communicate()[1]}")
        time.sleep(0.2)


def stop(process: subprocess.Popen[str]) -> str:
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=60)
    assert process.returncode == 0, err
    return err


def test_sigterm_drains_streams_and_a_restarted_engine_reuses_the_kv(tmp_path: Path) -> None:
    tokenizer = embedded_tokenizer()
    folder = tmp_path / "tiny"
    save_folder(folder, tokenizer)
    disk = tmp_path / "kv"
    port = free_port()
    process = start(folder, disk, port)
    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
    try:
        stream = client.completions.create(
            model="tiny",
            prompt=PROMPT,
            max_tokens=400,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        chunks = iter(stream)
        first = next(chunks)
        received: list[Any] = [first]
        reader = threading.Thread(target=lambda: received.extend(chunks))
        reader.start()
        err = stop(process)  # SIGTERM while the stream is in flight
        reader.join(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    assert received[-1].choices[0].finish_reason == "length"  # drained, not cut
    assert "draining in-flight requests and writing KV to disk" in err
    assert "model runner: kvtier (llama family; CPU kernels:" in err  # kvtier's forward
    assert any(disk.iterdir())

    # The restart, in-process: an engine on the same folder and disk finds the KV there.
    config = engine_config(disk_dir=str(disk))
    with Engine.from_pretrained(str(folder), config) as restarted:
        again = restarted.submit(PROMPT, SamplingParams(max_tokens=1)).result()
        by_tier = restarted.stats().reused_tokens_by_tier
    prompt_tokens = len(again.prompt_ids)
    assert again.reused_tokens == 16 * ((prompt_tokens - 1) // 16) > 0
    assert by_tier == {"disk": again.reused_tokens}


def test_serve_flags_put_the_shared_tier_below_disk() -> None:
    from kvtier.config import DiskConfig, RemoteConfig
    from kvtier.server.launch import engine_config as serve_engine_config
    from kvtier.server.launch import parse_args

    flags = ["--disk-dir", "/tmp/kv", "--remote", "redis://u:p@10.0.0.1:7000,10.0.0.2:7000"]
    flags += ["--remote-prefix", "team", "--remote-ttl-s", "60", "--remote-timeout-s", "0.2"]
    tiers = serve_engine_config(parse_args(flags)).manager.lower_tiers
    assert [type(t) for t in tiers] == [DiskConfig, RemoteConfig]
    remote = tiers[1]
    assert isinstance(remote, RemoteConfig)
    assert (remote.key_prefix, remote.ttl_s, remote.timeout_s) == ("team", 60.0, 0.2)
    assert remote.url.endswith("10.0.0.2:7000")


def test_serve_eviction_policy_flag_reaches_host_and_disk() -> None:
    from kvtier.server.launch import engine_config as serve_engine_config
    from kvtier.server.launch import parse_args

    flags = ["--disk-dir", "/tmp/kv", "--eviction-policy", "s3fifo+prefix"]
    manager = serve_engine_config(parse_args(flags)).manager
    assert [t.eviction_policy for t in manager.tiers] == ["s3fifo+prefix"] * 2
    assert serve_engine_config(parse_args([])).manager.host.eviction_policy == "lru"
    with pytest.raises(SystemExit):
        parse_args(["--eviction-policy", "lfu"])


def test_serve_codec_flags_reach_host_disk_and_the_shared_tier() -> None:
    from kvtier.server.launch import engine_config as serve_engine_config
    from kvtier.server.launch import parse_args

    flags = ["--disk-dir", "/tmp/kv", "--disk-codec", "int8", "--host-codec", "fp8"]
    flags += ["--remote", "redis://10.0.0.2:7000", "--remote-codec", "int4"]
    manager = serve_engine_config(parse_args(flags)).manager
    assert [t.codec for t in (manager.host, *manager.lower_tiers)] == ["fp8", "int8", "int4"]
    plain = serve_engine_config(parse_args(["--disk-dir", "/tmp/kv"])).manager
    assert [t.codec for t in (plain.host, *plain.lower_tiers)] == ["raw", "raw"]  # exact
    with pytest.raises(SystemExit):
        parse_args(["--disk-codec", "int2"])
