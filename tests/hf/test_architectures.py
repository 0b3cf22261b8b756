"""Which architectures kvtier runs: exactly (greedy tokens equal ``DynamicCache``'s), or not
at all (refused when the cache is built, with one line naming the model type and why)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import DynamicCache

from kvtier.config import TieredCacheConfig
from kvtier.engine import Engine, EngineConfig
from kvtier.hf import TieredCache
from kvtier.hf.generate import generate
from kvtier.kv import KVLayout
from kvtier.kv.spec import UnsupportedModelError
from kvtier.models import random_model

CHUNK = 16
PROMPT_TOKENS = 150  # > 4 windows of the refused sliding models below
GREEDY = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)

# Every layer full attention, or a window at least as long as the context (never drops a
# key): these run exactly.
EXACT: dict[str, dict[str, Any]] = {
    "llama": {},
    "qwen2": {},
    "qwen3": {},
    "mistral": {},
    "phi3": {},
    "olmo2": {},
    "cohere": {},
    "granite": {},
    "starcoder2": {},
    "gpt_neox": {},
    "gemma": {},
    "stablelm": {},
    "glm": {},
    "smollm3": {},
    "helium": {},
    "gemma3_text (window >= context)": {"sliding_window": 4096},
}

REFUSED: dict[str, tuple[dict[str, Any], str]] = {
    "mistral with a sliding window": (
        {"sliding_window": 32},
        "kvtier cannot run mistral exactly: layers 0, 1 attend over a sliding window of 32",
    ),
    "qwen2 with sliding layers": (
        {"use_sliding_window": True, "sliding_window": 32, "max_window_layers": 1},
        "kvtier cannot run qwen2 exactly: layer 1 attends over a sliding window of 32",
    ),
    "gemma3_text": (
        {"sliding_window": 32},
        "kvtier cannot run gemma3_text exactly: layers 0, 1 attend over a sliding window",
    ),
    "gemma2": (
        {"sliding_window": 4096},
        "kvtier cannot run gemma2 exactly: its attention soft-caps",
    ),
    "starcoder2 with a sliding window": (
        {"sliding_window": 32},
        "kvtier cannot run starcoder2 exactly: layers 0, 1 attend over a sliding window",
    ),
}


def arch_of(name: str) -> str:
    return name.split()[0]


def prompt() -> torch.Tensor:
    return torch.randint(3, 256, (1, PROMPT_TOKENS), generator=torch.Generator().manual_seed(5))


def config_for(model: Any, chunks: int) -> TieredCacheConfig:
    layout = KVLayout.from_model_config(model.config, torch.float32, CHUNK)
    return TieredCacheConfig(
        device_budget_bytes=chunks * layout.chunk_nbytes, staging_bytes=2 * layout.layer_nbytes
    )


@pytest.mark.parametrize("budget_chunks", [1, 3, 64], ids=["one-chunk", "few", "all"])
@pytest.mark.parametrize("name", list(EXACT))
def test_greedy_tokens_equal_dynamic_cache(name: str, budget_chunks: int) -> None:
    model = random_model(arch_of(name), seed=2, **EXACT[name])
    ids = prompt()
    with torch.no_grad():
        expected = model.generate(ids, cache=DynamicCache(config=model.config), **GREEDY)
        cache = TieredCache(model, config_for(model, budget_chunks), chunk_tokens=CHUNK)
        got = model.generate(ids, cache=cache, **GREEDY)
    assert torch.equal(got, expected)
    assert cache.peak_device_nbytes <= cache.config.device_budget_bytes


@pytest.mark.parametrize("name", ["qwen3", "gpt_neox", "gemma3_text (window >= context)"])
def test_next_turn_reuse_gives_the_same_tokens(name: str) -> None:
    model = random_model(arch_of(name), seed=2, **EXACT[name])
    ids = prompt()
    first = TieredCache(model, config_for(model, 3), chunk_tokens=CHUNK)
    with torch.no_grad():
        out = model.generate(ids, cache=first, **GREEDY)
        turn2 = torch.cat([out, torch.randint(3, 256, (1, 20))], dim=1)
        expected = model.generate(turn2, cache=DynamicCache(config=model.config), **GREEDY)
        again = TieredCache(model, config_for(model, 3), manager=first.manager)
        result = generate(model, again, turn2, max_new_tokens=12)
    assert result.reused_tokens > 0
    assert torch.equal(result.sequences, expected)


@pytest.mark.parametrize("name", list(REFUSED))
def test_models_kvtier_cannot_run_exactly_are_refused_in_one_line(name: str) -> None:
    overrides, message = REFUSED[name]
    model = random_model(arch_of(name), **overrides)
    with pytest.raises(UnsupportedModelError) as info:
        TieredCache(model, chunk_tokens=CHUNK)
    text = str(info.value)
    assert text.startswith(message) and "\n" not in text
    with pytest.raises(UnsupportedModelError):  # the engine builds its caches at start
        Engine(model, None, EngineConfig(max_batch_size=1))


def test_head_counts_that_disagree_with_the_modules_get_the_named_error() -> None:
    model = random_model("llama")
    model.config.num_key_value_heads = 1  # the modules project 2 KV heads
    with pytest.raises(UnsupportedModelError, match=r"^llama: layer 0's attention module has 2"):
        TieredCache(model, chunk_tokens=CHUNK)


def test_keys_that_disagree_with_the_layout_are_refused_at_the_first_update() -> None:
    model = random_model("gpt_neox")  # fused QKV: the modules name no KV head count
    model.config.num_key_value_heads = 2  # but they project 4
    cache = TieredCache(model, chunk_tokens=CHUNK)
    with pytest.raises(UnsupportedModelError, match=r"^gpt_neox: layer 0 produced keys of "):
        model.generate(prompt(), cache=cache, **GREEDY)
