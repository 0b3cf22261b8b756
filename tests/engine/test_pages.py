"""Fine-grained reuse: a prompt seen before recomputes fewer than ``page_tokens`` tokens past
its last whole chunk (a partial chunk's whole pages are reused), exactly, per tenant; the
lower tiers still move whole chunks."""

from __future__ import annotations

from typing import Any

import torch

from kvtier.config import HostConfig, ManagerConfig, TieredCacheConfig
from kvtier.engine import Engine, EngineConfig, SamplingParams
from kvtier.hf import TieredCache
from kvtier.hf.generate import generate
from kvtier.kv import KVLayout
from kvtier.manager import KVManager
from kvtier.models import model_config, model_identity
from tests.engine.tiny import reference_tokens

CHUNK, PAGE = 64, 16
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def chunk_nbytes() -> int:
    return KVLayout.from_model_config(model_config("llama"), torch.float32, CHUNK).chunk_nbytes


def config(runner: str = "auto") -> EngineConfig:
    nbytes = chunk_nbytes()
    return EngineConfig(
        max_batch_size=2,
        runner=runner,
        cache=TieredCacheConfig(
            device_budget_bytes=4 * nbytes, staging_bytes=2 * nbytes, page_tokens=PAGE
        ),
        manager=ManagerConfig(chunk_tokens=CHUNK, host=HostConfig(capacity_bytes=64 * nbytes)),
    )


def prompt(length: int, base: int = 300) -> list[int]:
    return [base + (7 * i) % 997 for i in range(length)]


def pages(num_tokens: int) -> int:
    """What a prompt of ``num_tokens`` can reuse at most: whole pages, one token computed."""
    return ((num_tokens - 1) // PAGE) * PAGE


def test_a_prompt_seen_before_recomputes_less_than_a_page(model: Any, tokenizer: Any) -> None:
    p = prompt(4 * CHUNK + 40)  # 296 tokens: 4 chunks + 40 in the tail
    with Engine(model, tokenizer, config()) as engine:
        first = engine.submit(p, GREEDY).result()
        again = engine.submit(p, GREEDY).result()
        # A next turn reuses the pages the first turn's tail held when it finished.
        turn = p + first.token_ids + [41, 42, 43]
        follow = engine.submit(turn, GREEDY).result()
    assert first.reused_tokens == 0
    assert again.reused_tokens == pages(len(p)) == 288  # 8 tokens recomputed
    assert len(p) - again.reused_tokens <= PAGE
    held = len(p) + len(first.token_ids) - 1  # what the first turn's KV covered at its end
    assert follow.reused_tokens == (held // PAGE) * PAGE
    expected = reference_tokens(model, p, 10)
    assert first.token_ids == again.token_ids == expected
    assert follow.token_ids == reference_tokens(model, turn, 10)


def test_a_prompt_of_whole_chunks_reuses_the_pages_of_its_last_one(
    model: Any, tokenizer: Any
) -> None:
    p = prompt(3 * CHUNK)  # the last chunk is sealed whole; one token must be computed
    with Engine(model, tokenizer, config()) as engine:
        engine.submit(p, GREEDY).result()
        again = engine.submit(p, GREEDY).result()
    assert again.reused_tokens == pages(len(p)) == 3 * CHUNK - PAGE
    assert again.token_ids == reference_tokens(model, p, 10)


def test_pages_are_matched_by_token_ids_and_tenant(model: Any, tokenizer: Any) -> None:
    p = prompt(3 * CHUNK + 50)
    changed = list(p)
    changed[3 * CHUNK + 20] += 1  # differs inside the partial chunk's pages
    with Engine(model, tokenizer, config()) as engine:
        engine.submit(p, GREEDY).result()
        other = engine.submit(changed, GREEDY).result()
        salted = engine.submit(p, GREEDY, cache_salt="tenant-b").result()
    assert other.reused_tokens == 3 * CHUNK  # whole chunks only: no page after the change
    assert other.token_ids == reference_tokens(model, changed, 10)
    assert salted.reused_tokens == 0  # another tenant's namespace: nothing to find
    assert salted.token_ids == reference_tokens(model, p, 10)


def test_transformers_runner_reuses_pages_too(model: Any, tokenizer: Any) -> None:
    p = prompt(2 * CHUNK + 33)
    with Engine(model, tokenizer, config(runner="transformers")) as engine:
        engine.submit(p, GREEDY).result()
        again = engine.submit(p, GREEDY).result()
    assert again.reused_tokens == pages(len(p))
    assert again.token_ids == reference_tokens(model, p, 10)


def test_tiered_cache_next_turn_reuses_the_tails_pages(model: Any) -> None:
    nbytes = chunk_nbytes()
    layout = KVLayout.from_model_config(model.config, torch.float32, CHUNK)
    manager = KVManager(
        layout,
        model_identity(model),
        ManagerConfig(chunk_tokens=CHUNK, host=HostConfig(capacity_bytes=64 * nbytes)),
    )
    cache_config = TieredCacheConfig(device_budget_bytes=3 * nbytes, page_tokens=PAGE)
    ids = torch.tensor([prompt(2 * CHUNK + 50)])
    first = generate(model, TieredCache(model, cache_config, manager), ids, max_new_tokens=6)
    turn = torch.cat([first.sequences, torch.tensor([[11, 12, 13]])], dim=1)
    second = generate(model, TieredCache(model, cache_config, manager), turn, max_new_tokens=6)
    held = first.sequences.shape[1] - 1
    assert second.reused_tokens == (held // PAGE) * PAGE
    expected = reference_tokens(model, turn[0].tolist(), 6)
    assert second.sequences[0, turn.shape[1] :].tolist() == expected
    manager.close()
