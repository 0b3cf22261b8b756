"""The placement cost model: how many non-resident chunks a pass attends on the host, and
the plan it leads to (tokens still exact)."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from kvtier.config import PlacementRates, TieredCacheConfig
from kvtier.hf.cache import TieredCache
from kvtier.kv.layout import KVLayout
from kvtier.models import random_model
from kvtier.runtime.cost import choose_hosted, predict_s

MB = 10**6


def test_a_slow_link_on_a_cpu_only_machine_puts_everything_on_the_host() -> None:
    rates = PlacementRates(link_gbps=0.5, host_attention_gbps=14, device_attention_gbps=14)
    assert choose_hosted(20, 10 * MB, rates) == 20


def test_a_link_hidden_behind_compute_streams_everything_where_the_host_would_delay_it() -> None:
    """Streaming 200 MB at 25 GB/s (8 ms) hides behind 30 ms of compute; host attention on
    the same cores would add to it."""
    rates = PlacementRates(
        link_gbps=25, host_attention_gbps=5, device_attention_gbps=3000, compute_s=0.03
    )
    assert choose_hosted(20, 10 * MB, rates) == 0


def test_host_cores_of_their_own_take_what_fits_beside_the_compute() -> None:
    """A GPU server: the host attends up to the 30 ms the device computes anyway."""
    rates = PlacementRates(
        link_gbps=25,
        host_attention_gbps=5,
        device_attention_gbps=3000,
        compute_s=0.03,
        concurrent=True,
    )
    k = choose_hosted(20, 10 * MB, rates)
    assert k == 15  # 150 MB at 5 GB/s = 30 ms
    assert predict_s(rates, (20 - k) * 10 * MB, k * 10 * MB) <= predict_s(rates, 200 * MB, 0)


def test_equal_rates_side_by_side_split_where_the_times_balance() -> None:
    rates = PlacementRates(
        link_gbps=10, host_attention_gbps=10, device_attention_gbps=1e6, concurrent=True
    )
    assert choose_hosted(20, 10 * MB, rates) == 10
    both = predict_s(rates, 10 * 10 * MB, 10 * 10 * MB)
    assert both == pytest.approx(predict_s(rates, 20 * 10 * MB, 0) / 2)


def test_bad_rates_and_placements_are_refused() -> None:
    with pytest.raises(ValueError, match="link_gbps: must be > 0"):
        PlacementRates(link_gbps=0, host_attention_gbps=1, device_attention_gbps=1)
    with pytest.raises(ValueError, match="placement: unknown 'nowhere'"):
        TieredCacheConfig(placement="nowhere")
    with pytest.raises(ValueError, match="needs rates"):
        TieredCacheConfig(placement="auto")


def test_auto_splits_a_pass_and_the_tokens_stay_exact() -> None:
    model = random_model("llama", seed=4)
    layout = KVLayout.from_model_config(model.config, torch.float32, 16)
    rates = PlacementRates(
        link_gbps=10, host_attention_gbps=10, device_attention_gbps=1e6, concurrent=True
    )
    config = TieredCacheConfig(
        device_budget_bytes=2 * layout.chunk_nbytes,
        staging_bytes=2 * layout.layer_nbytes,
        placement="auto",
        rates=rates,
    )
    ids = torch.randint(3, 256, (1, 150), generator=torch.Generator().manual_seed(3))
    greedy = {"max_new_tokens": 10, "do_sample": False}
    with torch.no_grad():
        expected = model.generate(ids, cache=DynamicCache(config=model.config), **greedy)
        cache = TieredCache(model, config, chunk_tokens=16)
        got = model.generate(ids, cache=cache, **greedy)
    assert torch.equal(got, expected)
    decided = cache.stats().decided_chunks
    assert decided["host"] > 0 and decided["stream"] > 0  # both, balanced per pass
    assert abs(decided["host"] - decided["stream"]) <= decided["host"] // 2
