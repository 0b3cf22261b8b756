"""The placement cost model: how many non-resident chunks a pass attends on the host, and
the plan it leads to (tokens still exact)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import DynamicCache

from kvtier.config import LinkConfig, PlacementRates, TieredCacheConfig
from kvtier.hf.cache import TieredCache
from kvtier.kv.layout import KVLayout
from kvtier.models import random_model
from kvtier.profiles import (
    PROFILE_VERSION,
    ProfileMissingError,
    machine_identity,
    placement_rates,
    profile_path,
    save_profile,
)
from kvtier.runtime.cost import choose_hosted, hosted_counter, predict_s
from kvtier.runtime.groups import LayerGroup

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


def test_auto_without_rates_reads_the_profile_or_says_to_calibrate(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVTIER_CACHE_DIR", str(tmp_path))
    model = random_model("llama", seed=4)
    config = TieredCacheConfig(placement="auto")
    with pytest.raises(ProfileMissingError, match="run `kvtier calibrate`"):
        TieredCache(model, config, chunk_tokens=16, model_id="tiny-llama")
    save_profile(PROFILE, profile_path("tiny-llama"))
    cache = TieredCache(model, config, chunk_tokens=16, model_id="tiny-llama")
    assert cache.config.rates == placement_rates(PROFILE)
    cache.close()


PROFILE = {
    "version": PROFILE_VERSION,
    "machine": {"identity": machine_identity(), "device": "cpu (no GPU)"},
    "model": {"id": "tiny-llama"},
    "link": {"h2d_gbps": 9.0},
    "attention": {
        "host": {"torch": {"1": 3.0, "2": 5.0}, "kvtier": {"1": 12.0, "2": 20.0}},
        "device": {"kernel": "kvtier", "gbps": 15.0},
    },
    "compute": {"decode": {"fit": {"ms": 40.0, "ms_per_context_token": 0.01}}},
}


def test_a_profile_gives_the_rates_at_the_thread_count() -> None:
    two = placement_rates(PROFILE, threads=2)
    assert two == PlacementRates(
        link_gbps=9.0, host_attention_gbps=20.0, device_attention_gbps=15.0, compute_s=0.04
    )
    assert placement_rates(PROFILE, threads=8).host_attention_gbps == 20.0  # the nearest below
    assert placement_rates(PROFILE, threads=1).host_attention_gbps == 12.0
    gpu = {**PROFILE, "machine": {"device": "NVIDIA H200"}}
    assert placement_rates(gpu).concurrent
    with pytest.raises(ValueError, match="lacks 'attention'"):
        placement_rates({"link": {"h2d_gbps": 1.0}})


def test_a_link_throttle_caps_the_link_rate_the_model_assumes() -> None:
    """At 10 GB/s four chunks hide behind 1 ms of compute and stream; throttled to
    1e-4 GB/s they would take longer than attending them on the host."""
    model = random_model("llama", seed=4)
    layout = KVLayout.from_model_config(model.config, torch.float32, 16)
    rates = PlacementRates(
        link_gbps=10, host_attention_gbps=5, device_attention_gbps=1e6, compute_s=1e-3
    )
    groups = [LayerGroup(window=None, layers=tuple(range(layout.num_layers)))]
    free = hosted_counter(TieredCacheConfig(placement="auto", rates=rates), layout, groups)
    slow = hosted_counter(
        TieredCacheConfig(placement="auto", rates=rates, link=LinkConfig(gbps=1e-4)),
        layout,
        groups,
    )
    assert free is not None and slow is not None
    assert free(0, 4) == 0 and slow(0, 4) == 4


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


def test_every_decision_is_counted_with_its_predicted_and_measured_seconds() -> None:
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
        link=LinkConfig(gbps=5),
    )
    ids = torch.randint(3, 256, (1, 150), generator=torch.Generator().manual_seed(3))
    cache = TieredCache(model, config, chunk_tokens=16)
    with torch.no_grad():
        model.generate(ids, cache=cache, max_new_tokens=6, do_sample=False)
    stats = cache.stats()
    cache.close()
    host, stream = stats.decisions["host"], stats.decisions["stream"]
    assert host.nbytes == host.chunks * layout.chunk_nbytes  # one group: all layers
    assert host.predicted_s == pytest.approx(host.nbytes / 10e9)
    assert stream.predicted_s == pytest.approx(stream.nbytes / 5e9)  # the throttle
    assert host.measured_s is not None and host.measured_s > 0
    assert stream.measured_s == stats.link.busy_s > 0
    assert stats.decisions["resident"].predicted_s is None
    assert stats.decided_chunks == {d: c.chunks for d, c in stats.decisions.items()}
    table = stats.table()
    assert "predicted s" in table and "measured s" in table
    assert any(
        line.startswith("host") and line.split()[1] == str(host.chunks)
        for line in table.splitlines()
    )
