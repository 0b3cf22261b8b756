"""The embedded SmolLM2-135M: TieredCache's greedy tokens equal DynamicCache's (slow)."""

from __future__ import annotations

import pytest
import torch

from kvtier.config import TieredCacheConfig
from kvtier.hf import TieredCache
from kvtier.hf.generate import generate, generate_resident
from kvtier.kv import KVLayout
from kvtier.models import chat_ids, load_model

pytestmark = pytest.mark.slow

NEW_TOKENS = 12


@pytest.fixture(scope="module")
def embedded() -> object:
    return load_model()


def prompts(tokenizer: object) -> list[torch.Tensor]:
    """Three prompts: a short chat question, a medium one, and one over 4K tokens."""

    def chat(text: str) -> torch.Tensor:
        return chat_ids(tokenizer, [{"role": "user", "content": text}])

    story = " ".join(
        f"Line {i}: the lighthouse keeper counted {i * 7 % 31} ships." for i in range(60)
    )
    long_doc = " ".join(f"Entry {i}: the value of item {i} is {i * 13 % 97}." for i in range(330))
    return [
        chat("What is the capital of France?"),
        chat(story + " How many lines were there?"),
        chat(long_doc + " What is the value of item 5?"),
    ]


@pytest.fixture(scope="module")
def references(embedded: object) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each prompt and its greedy tokens with transformers' own cache (computed once)."""
    model, tokenizer = embedded.model, embedded.tokenizer  # type: ignore[attr-defined]
    all_prompts = prompts(tokenizer)
    assert all_prompts[2].shape[1] > 4096
    return [
        (ids, generate_resident(model, ids, max_new_tokens=NEW_TOKENS, do_sample=False).sequences)
        for ids in all_prompts
    ]


@pytest.mark.parametrize("budget_share", [0.10, 1.0])  # most KV offloaded; all resident
def test_greedy_tokens_equal_dynamic_cache(
    embedded: object, references: list[tuple[torch.Tensor, torch.Tensor]], budget_share: float
) -> None:
    model = embedded.model  # type: ignore[attr-defined]
    layout = KVLayout.from_model_config(model.config, torch.float32, 256)
    for ids, expected in references:
        kv_nbytes = layout.kv_nbytes(ids.shape[1] + NEW_TOKENS)
        budget = max(int(budget_share * kv_nbytes), layout.chunk_nbytes)
        cache = TieredCache(model, TieredCacheConfig(device_budget_bytes=budget))
        got = generate(model, cache, ids, max_new_tokens=NEW_TOKENS, do_sample=False)
        assert torch.equal(got.sequences, expected), (ids.shape, budget_share)
        assert cache.peak_device_nbytes <= budget
        cache.close()
