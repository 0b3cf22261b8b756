"""``kvtier serve --write-policy write_through`` killed with SIGKILL while a completion
streams: a restart on the same disk directory finds every byte its ``/metrics`` said the
disk held just before the kill, reuses the KV of every prompt sealed more than two seconds
before it, and answers exactly as before (issue 8, item 5; issue 12, item 5)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvbench.crash import prompts, run_policy
from tests.engine.tiny import embedded_tokenizer, save_folder

pytestmark = pytest.mark.slow


def test_write_through_survives_kill_9(tmp_path: Path) -> None:
    tokenizer = embedded_tokenizer()
    folder = tmp_path / "tiny"
    save_folder(folder, tokenizer)
    texts = prompts(4, 60, seed=1)  # distinct: every reused token comes from disk
    result = run_policy(str(folder), tmp_path, "write_through", texts, settle_s=2.5)
    assert result["cacheable_tokens"] > 0
    # Every whole chunk sealed before the kill comes back (pages of partial ones may too).
    assert result["cached_tokens_after_kill"] >= result["sealed_chunk_tokens"] > 0, result
    assert result["outputs_identical"], result
    assert result["disk_bytes_reported_before_kill"] > 0, result
    assert result["durable_found_again"], result  # killed mid-stream
