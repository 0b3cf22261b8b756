"""End-to-end smoke runs of ``serve`` and ``multiturn`` on a tiny random-weight model (the
embedded model's tokenizer): the pieces fit together and the JSON has its summary. No
timing is asserted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvbench import flood, multiturn, serve
from tests.engine.tiny import embedded_tokenizer, tiny_model

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tokenizer = embedded_tokenizer()
    folder = tmp_path_factory.mktemp("tiny")
    tiny_model(tokenizer).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_serve_replays_a_trace_against_three_servers(tiny_folder: Path, tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    rows = [
        {"timestamp": 0, "input_length": 1536, "output_length": 9, "hash_ids": [0, 1, 2]},
        {"timestamp": 3000, "input_length": 700, "output_length": 2, "hash_ids": [0, 3]},
        {"timestamp": 6000, "input_length": 2048, "output_length": 9, "hash_ids": [0, 1, 2, 4]},
    ]
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "serve.json"
    threads = torch.get_num_threads()
    argv = ["--model", str(tiny_folder), "--trace", str(trace), "--json", str(out)]
    argv += ["--requests", "3", "--user-fraction", "1", "--block-tokens", "16"]
    argv += ["--max-output-tokens", "4", "--time-factor", "10", "--device-budget-mb", "1"]
    argv += ["--disk-mb", "16", "--dir", str(tmp_path)]
    try:
        assert serve.main(argv) == 0
    finally:
        torch.set_num_threads(threads)
    result = json.loads(out.read_text())
    summary = result["summary"]
    assert summary["all_ok"] and summary["requests"] == 3
    # Block 0 and the extended conversation (its first turn done 0.3 s before): 16 + 48.
    assert summary["device_only_reused_tokens"] == 64
    assert summary["reused_tokens_ratio_vs_device_only"] == 1.0
    assert summary["ttft_p50_ratio_vs_device_only"] > 0
    assert set(result["cases"]) == set(serve.CONFIGS)
    assert all(c[0]["server_exit_code"] == 0 for c in result["cases"].values())
    assert not list(tmp_path.glob("kvtier-bench-serve-*"))  # the work folder is removed


def test_multiturn_reuses_each_users_history(tiny_folder: Path, tmp_path: Path) -> None:
    out = tmp_path / "multiturn.json"
    threads = torch.get_num_threads()
    argv = ["--model", str(tiny_folder), "--json", str(out), "--users", "2", "--rounds", "2"]
    argv += ["--first-tokens", "256", "--message-tokens", "20", "40", "--device-budget-mb", "1"]
    try:
        assert multiturn.main(argv) == 0
    finally:
        torch.set_num_threads(threads)
    result = json.loads(out.read_text())
    summary = result["summary"]
    assert summary["tokens_identical"] and summary["every_later_round_reused"]
    assert summary["reused_tokens_by_tier_round2"] == {"host": 512}
    assert summary["ttft_speedup_round2"] > 0
    assert [t["round"] for t in result["cases"]["turns"]] == [1, 1, 2, 2]


def test_a_flood_of_long_prompts_gets_200s_and_429s_and_the_server_serves_on(
    tiny_folder: Path, tmp_path: Path
) -> None:
    """A real ``kvtier serve`` with a 1 s queue bound: the flood's answers are 200 or 429
    with a ``Retry-After``, some of each; memory stays within the tiers it was given; the
    steady load after it is served in full."""
    settings = flood.Settings(
        host_mb=64,
        device_budget_mb=4,
        max_batch_size=4,
        max_queue_s=1.0,
        chunk_tokens=16,
        steady=4,
        clients=2,
        steady_tokens=8,
        flood=24,
        flood_words=1200,
        flood_tokens=48,
    )
    result = flood.run(str(tiny_folder), settings, tmp_path, seed=0)
    summary = result["summary"]
    assert summary["only_200_or_429"] and summary["every_429_has_retry_after"]
    assert summary["served"] > 0 and summary["refused"] > 0, result["flood"]
    assert summary["memory_within_budgets"], result["memory"]
    assert result["after"]["statuses"] == [200]
    assert result["after"]["output_tokens"] == settings.steady * settings.steady_tokens
    assert summary["server_exit_code"] == 0
