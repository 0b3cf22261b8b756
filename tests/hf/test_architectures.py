"""Which architectures kvtier runs: exactly (greedy tokens equal ``DynamicCache``'s), or not
at all (refused when the cache is built, with one line naming the model type and why).

Sliding-window and hybrid models (layers that alternate sliding and full attention) run
with prompts of at least four windows, so a layer that attended past its window would
change the tokens. Gemma 2 runs with its attention scores soft-capped (the published cap of
50, and a cap of 5), its query and key projections scaled up (``attention_gain``) so that
the scores reach the cap: a missing cap would change the tokens (checked)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

from kvtier.config import DiskConfig, HostConfig, ManagerConfig, TieredCacheConfig
from kvtier.engine import Engine, EngineConfig
from kvtier.hf import TieredCache
from kvtier.hf.generate import generate
from kvtier.kv import KVLayout
from kvtier.kv.spec import UnsupportedModelError
from kvtier.manager import KVManager
from kvtier.models import SHAPES, model_identity, random_model

CHUNK = 16
PROMPT_TOKENS = 150  # > 4 windows of the sliding models below
GREEDY = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)

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
    "mistral (sliding window 32)": {"sliding_window": 32},
    "qwen2 (sliding layers)": {
        "use_sliding_window": True,
        "sliding_window": 32,
        "max_window_layers": 1,
    },
    "gemma3_text (all sliding)": {"sliding_window": 32},
    "gemma3_text (hybrid)": {
        "sliding_window": 24,
        "num_hidden_layers": 4,
        "sliding_window_pattern": 2,
    },
    "starcoder2 (sliding window 36)": {"sliding_window": 36},
    "phi3 (sliding window 32)": {"sliding_window": 32},
    "gemma2 (hybrid, no soft-capping)": {
        "sliding_window": 32,
        "attn_logit_softcapping": None,
        "num_hidden_layers": 4,
    },
    "gemma2 (hybrid, soft-capped at 50)": {
        "sliding_window": 32,
        "num_hidden_layers": 4,
        "attention_gain": 30,
    },
    "gemma2 (hybrid, soft-capped at 5)": {
        "sliding_window": 32,
        "num_hidden_layers": 4,
        "attention_gain": 30,
        "attn_logit_softcapping": 5.0,
    },
}
HYBRID = "gemma3_text (hybrid)"
CAPPED = [name for name in EXACT if "soft-capped" in name]

# (model type, config fields, attention implementation, the message's start)
REFUSED: dict[str, tuple[str, dict[str, Any], str, str]] = {
    "gpt_oss (sinks)": (
        "gpt_oss",
        {"sliding_window": 32},
        "eager",
        "kvtier cannot run gpt_oss exactly: its attention has learned sinks",
    ),
    "qwen3_next (linear attention)": (
        "qwen3_next",
        {},
        "sdpa",
        "kvtier cannot run qwen3_next exactly: layers 0, 1 attend with linear_attention",
    ),
    "llama4_text (chunked attention)": (
        "llama4_text",
        {},
        "sdpa",
        "kvtier cannot run llama4_text exactly: layers 0, 1 attend with chunked_attention",
    ),
}


def test_prompts_are_at_least_four_windows() -> None:
    windows = [w for o in EXACT.values() if (w := o.get("sliding_window", 4096)) < 4096]
    assert windows and 4 * max(windows) <= PROMPT_TOKENS


def arch_of(name: str) -> str:
    return name.split()[0]


@pytest.mark.parametrize("name", CAPPED)
def test_the_soft_caps_change_the_tokens(name: str) -> None:
    """The capped models' greedy tokens differ without the cap: the cap is tested."""
    ids = prompt()
    tokens = []
    for cap in ({}, {"attn_logit_softcapping": None}):
        model = random_model(arch_of(name), seed=2, **{**EXACT[name], **cap})
        assert model.config.final_logit_softcapping == 30.0  # the published logit cap
        with torch.no_grad():
            tokens.append(model.generate(ids, cache=DynamicCache(config=model.config), **GREEDY))
    assert not torch.equal(tokens[0], tokens[1])


@pytest.mark.parametrize("name", CAPPED)
def test_an_attached_capped_model_runs_dynamic_cache_with_the_cap(name: str) -> None:
    """Once kvtier's attention is attached, plain tensors (``DynamicCache``) take its
    fallback, which caps too (SDPA cannot): the tokens stay eager attention's."""
    model = random_model(arch_of(name), seed=2, **EXACT[name])
    ids = prompt()
    with torch.no_grad():
        expected = model.generate(ids, cache=DynamicCache(config=model.config), **GREEDY)
        TieredCache(model, chunk_tokens=CHUNK)  # attaches kvtier's attention
        got = model.generate(ids, cache=DynamicCache(config=model.config), **GREEDY)
    assert model.config._attn_implementation == "kvtier"
    assert torch.equal(got, expected)


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
    # Sliding layers never hold more than their window (whole chunks) besides the tail.
    arena = cache.kv.arena
    for g, group in enumerate(arena.groups):
        reach = group.window_chunks(CHUNK)
        if reach is not None:
            chunk_nbytes = group.layout(arena.layout).chunk_nbytes
            assert arena.peak_group_nbytes[g] <= reach * chunk_nbytes
            assert reach * CHUNK < group.window + CHUNK


@pytest.mark.parametrize("name", list(EXACT))
def test_attending_on_the_host_gives_the_same_tokens_and_moves_nothing_over_the_link(
    name: str,
) -> None:
    """The chunks past the device budget are attended where they lie in the host pool."""
    model = random_model(arch_of(name), seed=2, **EXACT[name])
    ids = prompt()
    config = dataclasses.replace(config_for(model, 3), placement="host")
    with torch.no_grad():
        expected = model.generate(ids, cache=DynamicCache(config=model.config), **GREEDY)
        cache = TieredCache(model, config, chunk_tokens=CHUNK)
        got = model.generate(ids, cache=cache, **GREEDY)
        streamed = TieredCache(model, config_for(model, 3), chunk_tokens=CHUNK)
        model.generate(ids, cache=streamed, **GREEDY)
    assert torch.equal(got, expected)
    # every chunk read the stream path moves over the link is read on the host instead
    hosted, moved = cache.stats(), streamed.stats()
    assert hosted.link.bytes == 0 and "stream" not in hosted.decided_chunks
    assert hosted.decided_chunks.get("host", 0) == moved.decided_chunks.get("stream", 0)
    assert (moved.link.bytes > 0) == ("host" in hosted.decided_chunks)
    assert cache.peak_device_nbytes <= cache.config.device_budget_bytes


def make_manager(model: Any, disk: Any) -> KVManager:
    layout = KVLayout.from_model_config(model.config, torch.float32, CHUNK)
    config = ManagerConfig(
        chunk_tokens=CHUNK,
        host=HostConfig(capacity_bytes=64 * layout.chunk_nbytes),
        lower_tiers=() if disk is None else (DiskConfig(path=str(disk), fsync=False),),
    )
    return KVManager(layout, model_identity(model), config)


@pytest.mark.parametrize("tier", ["host", "disk"])
@pytest.mark.parametrize(
    "name",
    [
        "qwen3",
        "gpt_neox",
        "qwen2 (sliding layers)",
        "mistral (sliding window 32)",
        "gemma2 (hybrid, no soft-capping)",
        "gemma2 (hybrid, soft-capped at 5)",
        HYBRID,
    ],
)
def test_next_turn_reuse_gives_the_same_tokens(name: str, tier: str, tmp_path: Any) -> None:
    model = random_model(arch_of(name), seed=2, **EXACT[name])
    ids = prompt()
    disk = tmp_path if tier == "disk" else None
    manager = make_manager(model, disk)
    first = TieredCache(model, config_for(model, 3), manager=manager)
    with torch.no_grad():
        out = model.generate(ids, cache=first, **GREEDY)
    turn2 = torch.cat([out, torch.randint(3, 256, (1, 20))], dim=1)
    if disk is not None:  # a restart: the next turn finds the first turn's KV on disk only
        first.close()
        manager.close(flush_host_to_disk=True)
        manager = make_manager(model, disk)
    with torch.no_grad():
        expected = model.generate(turn2, cache=DynamicCache(config=model.config), **GREEDY)
        again = TieredCache(model, config_for(model, 3), manager=manager)
        result = generate(model, again, turn2, max_new_tokens=12)
    assert result.reused_tokens > 0
    assert torch.equal(result.sequences, expected)
    if disk is not None:
        assert manager.stats().tiers["disk"].hits > 0
    manager.close()


@pytest.mark.parametrize("name", [HYBRID, "gemma2 (hybrid, soft-capped at 5)"])
@pytest.mark.parametrize("on_host", [False, True], ids=["streamed", "on-host"])
def test_a_padded_batch_of_a_hybrid_model_equals_dynamic_cache(on_host: bool, name: str) -> None:
    model = random_model(arch_of(name), seed=2, **EXACT[name])
    ids = prompt().repeat(2, 1)
    mask = torch.ones_like(ids)
    ids[1, :40], mask[1, :40] = 0, 0  # the second row is left-padded
    with torch.no_grad():
        expected = model.generate(
            ids, attention_mask=mask, cache=DynamicCache(config=model.config), **GREEDY
        )
        config = dataclasses.replace(
            config_for(model, 3), placement="host" if on_host else "stream"
        )
        cache = TieredCache(model, config, chunk_tokens=CHUNK)
        got = model.generate(ids, attention_mask=mask, cache=cache, **GREEDY)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("name", list(REFUSED))
def test_models_kvtier_cannot_run_exactly_are_refused_in_one_line(name: str) -> None:
    model_type, overrides, implementation, message = REFUSED[name]
    config = AutoConfig.for_model(model_type, **{**SHAPES["tiny"], **overrides})
    model = AutoModelForCausalLM.from_config(config, attn_implementation=implementation).eval()
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


def test_sliding_layers_stream_only_the_chunks_their_window_reaches() -> None:
    ids = prompt()
    streamed: dict[int | None, int] = {}
    for window in (None, 32):
        model = random_model("mistral", seed=2, sliding_window=window)
        cache = TieredCache(model, config_for(model, 1), chunk_tokens=CHUNK)
        with torch.no_grad():
            model.generate(ids, cache=cache, **GREEDY)
        streamed[window] = cache.stats().link.bytes
    layout = KVLayout.from_model_config(random_model("mistral").config, torch.float32, CHUNK)
    steps = GREEDY["max_new_tokens"]
    # A 32-token window reaches at most 3 chunks of 16 before the tail (every layer slides).
    assert streamed[32] <= steps * 3 * layout.chunk_nbytes < streamed[None]
