"""``kvtier bench librarian`` end to end on a tiny random-weight llama: every setting runs
every strategy, the summary has its keys, and the tokens equal ``DynamicCache``'s. No
timing is asserted."""

from __future__ import annotations

import argparse

import pytest
import torch

from kvbench import librarian
from kvbench.setup import load_bench_model

pytestmark = pytest.mark.slow


def test_every_setting_runs_every_strategy_with_identical_tokens() -> None:
    torch.set_num_threads(1)
    args = argparse.Namespace(
        random_shape="tiny", dtype="float32", seed=0, model=None, device="cpu", threads=1
    )
    bench = load_bench_model(args, torch.device("cpu"), 1024 + 4)
    result = librarian.run(bench, (1024,), new_tokens=4, repeats=1, seed=0)
    settings = result["settings"]
    assert len(settings) == len(librarian.BUDGETS) * 3  # real, compute-bound, link-bound
    for r in settings.values():
        assert set(r["step_s"]) == set(librarian.STRATEGIES) and r["tokens_identical"]
        assert r["best_fixed"] in librarian.FIXED and r["auto_host_share"] is not None
    summary = result["summary"]
    assert summary["tokens_identical"] and summary["settings"] == 6
    for key in (
        "speedup_vs_stream_only_link_bound",
        "ratio_vs_stream_only_compute_bound",
        "max_regret",
    ):
        assert summary[key] is not None
