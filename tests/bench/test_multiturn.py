"""``kvtier bench multiturn``: conversations, engine configs, and the summary arithmetic."""

from __future__ import annotations

import pytest
import torch

from kvbench.multiturn import (
    CHUNK_TOKENS,
    FIRST_TOKEN_ID,
    NEW_TOKENS,
    Turn,
    by_round,
    kvtier_config,
    main,
    message_ids,
    recompute_config,
    summarize,
)
from kvtier.config import MiB
from kvtier.kv import KVLayout


def test_messages_are_seeded_per_user_and_round() -> None:
    a = message_ids(0, user=1, round_=2, tokens=(30, 60), vocab_size=500)
    assert a == message_ids(0, 1, 2, (30, 60), 500)  # whatever was drawn before
    assert 30 <= len(a) <= 60
    assert min(a) >= FIRST_TOKEN_ID and max(a) < 500
    assert a != message_ids(0, 2, 2, (30, 60), 500)
    assert a != message_ids(1, 1, 2, (30, 60), 500)
    assert len(message_ids(0, 0, 0, (40, 40), 500)) == 40


def test_recompute_engine_holds_the_whole_sequence_on_its_device() -> None:
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, chunk_tokens=CHUNK_TOKENS)
    config = recompute_config(layout, prompt_tokens=1000)
    chunks = -(-(1000 + NEW_TOKENS) // CHUNK_TOKENS)
    assert config.cache.device_budget_bytes >= (chunks + 1) * layout.chunk_nbytes
    assert config.manager.host.capacity_bytes >= chunks * layout.chunk_nbytes
    assert config.max_batch_size == 1
    assert config.manager.chunk_tokens == CHUNK_TOKENS


def test_kvtier_engine_batches_continuously_on_a_small_device_budget() -> None:
    config = kvtier_config(device_budget_mb=32, host_mb=1024)
    assert config.max_batch_size > 1
    assert config.cache.device_budget_bytes == 32 * MiB
    assert config.manager.host.capacity_bytes == 1024 * MiB
    assert config.manager.chunk_tokens == CHUNK_TOKENS


def turn(user: int, round_: int, kv_s: float, re_s: float, **kwargs: object) -> Turn:
    defaults: dict[str, object] = dict(
        prompt_tokens=1000 * round_,
        reused_tokens=0 if round_ == 1 else 900,
        reused_tokens_by_tier={} if round_ == 1 else {"host": 900},
        same_tokens=True,
    )
    return Turn(user, round_, kvtier_ttft_s=kv_s, recompute_ttft_s=re_s, **{**defaults, **kwargs})  # type: ignore[arg-type]


TURNS = [
    turn(0, 1, 2.0, 2.0),
    turn(1, 1, 2.2, 2.0),
    turn(0, 2, 1.0, 4.0),
    turn(1, 2, 1.0, 6.0),
    turn(0, 3, 1.0, 10.0),
    turn(1, 3, 0.5, 10.0),
]


def test_speedup_is_recompute_over_kvtier() -> None:
    assert TURNS[2].speedup == 4.0


def test_by_round_takes_medians_over_users() -> None:
    rounds = by_round(TURNS)
    assert list(rounds) == ["1", "2", "3"]
    assert rounds["2"]["speedup"] == 5.0
    assert rounds["3"]["kvtier_ttft_s"] == 0.75
    assert rounds["1"]["reused_tokens"] == 0


def test_summary_takes_the_median_over_users_and_later_rounds() -> None:
    summary = summarize(TURNS, device_budget_nbytes=10, token_nbytes=1)
    assert summary["ttft_speedup_round2"] == pytest.approx(8.0)  # of 4, 6, 10, 20
    assert summary["ttft_speedup_by_round"]["3"] == 15.0
    assert summary["reused_tokens_by_tier_round2"] == {"host": 3600}
    assert summary["reused_fraction_round2"] == pytest.approx(3600 / 10000)
    assert summary["every_later_round_reused"] and summary["tokens_identical"]
    assert summary["kv_left_device"]


def test_summary_flags_what_went_wrong() -> None:
    turns = [*TURNS, turn(2, 2, 1.0, 3.0, same_tokens=False, reused_tokens=0)]
    summary = summarize(turns, device_budget_nbytes=10, token_nbytes=1)
    assert not summary["tokens_identical"] and not summary["every_later_round_reused"]
    # A device budget that holds a prompt, or a chunk found on the device: not shown to leave.
    assert not summarize(TURNS, device_budget_nbytes=10**6, token_nbytes=1)["kv_left_device"]
    on_device = [*TURNS, turn(2, 2, 1.0, 3.0, reused_tokens_by_tier={"device": 64})]
    assert not summarize(on_device, 10, 1)["kv_left_device"]
    assert summarize(TURNS[:2], 10, 1)["ttft_speedup_round2"] is None


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--users", "0"], "--users"),
        (["--rounds", "-1"], "--rounds"),
        (["--message-tokens", "600", "300"], "--message-tokens"),
        (["--threads", "0"], "--threads"),
    ],
)
def test_bad_flags_fail_before_loading_a_model(argv: list[str], message: str) -> None:
    threads = torch.get_num_threads()
    with pytest.raises(ValueError, match=message):
        main(argv)
    assert torch.get_num_threads() == threads
