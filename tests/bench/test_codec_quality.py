"""The codec bench's quality method on a tiny random-weight model: raw is the identity (full
agreement, zero KL, the cache untouched), a lossy codec changes the cache and the method sees
it; every chunk but the open tail is round-tripped."""

from __future__ import annotations

import copy

import torch
from transformers import DynamicCache

from kvbench import codec_quality as quality
from kvtier.codec import get_codec
from kvtier.kv.layout import KVLayout
from kvtier.random_weights import random_model


def _model_and_layout() -> tuple[object, KVLayout]:
    model = random_model("qwen2", "tiny", seed=3, attention_gain=8.0)
    return model, KVLayout.from_model_config(model.config, torch.float32, 16)


def test_raw_round_trip_leaves_the_cache_bit_identical_and_int8_changes_it() -> None:
    model, layout = _model_and_layout()
    cache = DynamicCache(config=model.config)  # type: ignore[attr-defined]
    ids = quality.random_windows(256, 2, 40, seed=0)
    with torch.inference_mode():
        model(ids, cache=cache, use_cache=True)  # type: ignore[operator]
    before = copy.deepcopy(cache)
    quality.round_trip(cache, layout, get_codec("raw"), 0, 32)
    for a, b in zip(quality.kv_layers(cache), quality.kv_layers(before), strict=True):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    quality.round_trip(cache, layout, get_codec("int8"), 0, 32)
    for a, b in zip(quality.kv_layers(cache), quality.kv_layers(before), strict=True):
        assert not torch.equal(a.keys[:, :, :32], b.keys[:, :, :32])
        assert torch.equal(a.keys[:, :, 32:], b.keys[:, :, 32:])  # the open tail is untouched
        torch.testing.assert_close(a.values, b.values, atol=0.05, rtol=0)


def test_raw_agrees_fully_and_int4_measures_a_loss() -> None:
    model, layout = _model_and_layout()
    windows = quality.random_windows(256, 3, 48, seed=1)
    codecs = {"raw": get_codec("raw"), "int4": get_codec("int4")}
    found = quality.measure(model, layout, windows, 16, codecs, batch=2)
    assert found["raw"].token_agreement == 1.0 and found["raw"].mean_kl == 0.0
    assert found["raw"].positions == found["int4"].positions == 3 * 32
    assert found["int4"].mean_kl > 0.0
    assert 0.0 <= found["int4"].token_agreement <= 1.0
