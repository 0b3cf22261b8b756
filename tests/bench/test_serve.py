"""``kvtier bench serve``: the server configurations, the summary and the flags."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvbench import BENCHMARKS
from kvbench.serve import (
    main,
    parse_args,
    same_texts,
    server_configs,
    summarize,
)


def test_the_benchmarks_are_registered() -> None:
    assert "serve" in BENCHMARKS and "multiturn" in BENCHMARKS


def test_summary_ratios_are_against_device_only() -> None:
    headlines: dict[str, dict[str, float | None]] = {
        "device_only": {"reused_tokens": 100.0, "ttft_p50_s": 2.0},
        "device_host": {"reused_tokens": 250.0, "ttft_p50_s": 1.0},
        "device_host_disk": {"reused_tokens": 300.0, "ttft_p50_s": 0.5},
    }
    summary = summarize(headlines)
    assert summary["reused_tokens_ratio_vs_device_only"] == 3.0
    assert summary["ttft_p50_ratio_vs_device_only"] == 0.25
    assert summary["device_host_reused_tokens_ratio_vs_device_only"] == 2.5
    assert summary["device_host_ttft_p50_ratio_vs_device_only"] == 0.5
    assert summary["device_host_ttft_p50_s"] == 1.0
    headlines["device_only"]["reused_tokens"] = 0.0
    del headlines["device_host"]
    summary = summarize(headlines)
    assert summary["reused_tokens_ratio_vs_device_only"] is None
    assert summary["device_host_ttft_p50_ratio_vs_device_only"] is None


def test_same_texts_needs_every_run_to_agree() -> None:
    texts: dict[str, list[dict[int, str | None]]] = {
        "device_only": [{0: "a", 1: "b", 2: "c"}],
        "device_host": [{0: "a", 1: "x", 2: None}],
    }
    assert same_texts(texts) == (1, 3)
    assert same_texts({}) == (0, 0)


def test_server_configs_size_the_tiers_from_the_device_budget(tmp_path: Path) -> None:
    configs = server_configs(64, 4, 8.0, 4096, chunk_tokens=64, max_queued=80)
    assert list(configs) == ["device_only", "device_host", "device_host_disk"]
    assert configs["device_only"].host_mb == 256 and configs["device_only"].disk_mb is None
    assert configs["device_host"].host_mb == 2048 and configs["device_host"].disk_mb is None
    assert configs["device_host_disk"].host_mb == 256
    flags = configs["device_host_disk"].flags(tmp_path)
    assert flags[flags.index("--disk-dir") + 1] == str(tmp_path)
    assert "--disk-dir" not in configs["device_only"].flags(None)
    assert flags[flags.index("--max-batch-size") + 1] == "4"
    with pytest.raises(ValueError, match="folder"):
        configs["device_host_disk"].flags(None)
    with pytest.raises(ValueError, match="--host-factor"):
        server_configs(64, 4, 0.5, 4096, 64, 80)


def test_flags_are_checked_before_anything_starts(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--repeats"):
        parse_args(["--repeats", "0"])
    with pytest.raises(FileNotFoundError, match="--trace"):
        main(["--trace", str(tmp_path / "none.jsonl")])
    args = parse_args(["--quick"])
    assert (args.requests, args.max_prompt_tokens, args.max_output_tokens) == (8, 512, 8)
