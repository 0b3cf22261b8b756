"""Two ``kvtier serve`` processes on one Redis Cluster, two tenants (``--salt-by-key``):
B serves A's prompt from the cluster for A's tenant (``cached_tokens``, ``/metrics`` by
tier), never for the other tenant or another ``cache_salt``, and answers alike."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest
from openai import OpenAI

from kvbench.redis_cluster import RedisCluster, available
from kvbench.serve_client import MODEL_NAME, by_label
from kvbench.server_process import Server, ServerConfig
from tests.engine.tiny import embedded_tokenizer, save_folder

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(available() is not None, reason=f"no Redis: {available()}"),
]

CHUNK_TOKENS = 16
KEYS = ("sk-tenant-one", "sk-tenant-two")


def start(name: str, workdir: Path, model: str, cluster: RedisCluster, prefix: str) -> Server:
    config = ServerConfig(
        name=name, device_budget_mb=128, max_batch_size=4, host_mb=256,
        chunk_tokens=CHUNK_TOKENS, max_queued=16,
    )  # fmt: skip
    server = Server(config, workdir, model, timeout_s=180)
    keys = workdir / "keys"
    keys.write_text("\n".join(KEYS) + "\n")
    server.command += ["--api-key-file", str(keys), "--salt-by-key"]
    server.command += ["--remote", cluster.url, "--remote-prefix", prefix]
    server.start()
    return server


def complete(server: Server, key: str, prompt: str, **extra: Any) -> tuple[str, int]:
    client = OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key=key)
    reply = client.completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=8, temperature=0, extra_body=extra or None
    )
    usage = reply.usage
    assert usage is not None
    details = usage.prompt_tokens_details
    return reply.choices[0].text, (details.cached_tokens or 0) if details else 0


def test_two_servers_share_kv_per_tenant_through_the_cluster(
    tmp_path: Path, redis_cluster: RedisCluster
) -> None:
    model = str(save_folder(tmp_path / "tiny", embedded_tokenizer()))
    prefix = f"test{uuid.uuid4().hex[:12]}"
    prompt = "The lighthouse keeper wrote in the log every night: " + "storm, calm, " * 40
    a = start("a", tmp_path, model, cluster=redis_cluster, prefix=prefix)
    try:
        text_a, cached_a = complete(a, KEYS[0], prompt)
    finally:
        a.stop()  # its write-behind drains into the cluster as it stops
    b = start("b", tmp_path, model, cluster=redis_cluster, prefix=prefix)
    try:
        same_tenant = complete(b, KEYS[0], prompt)
        other_tenant = complete(b, KEYS[1], prompt)
        other_salt = complete(b, KEYS[0], prompt, cache_salt="another")
        reused = by_label(b.metrics(), "kvtier_reused_tokens")
    finally:
        b.stop()
    assert cached_a == 0
    assert same_tenant[1] > 0 and same_tenant[1] % CHUNK_TOKENS == 0
    assert other_tenant[1] == 0 and other_salt[1] == 0  # nothing crosses tenants or salts
    assert text_a == same_tenant[0] == other_tenant[0] == other_salt[0]
    assert reused.get("remote") == same_tenant[1]  # B's only reuse came from the cluster
