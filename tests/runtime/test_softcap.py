"""Soft-capped layers (Gemma 2) route around kvtier's CPU kernels, which have no cap.

A Gemma 2 model with head size 64 on float32 CPU reaches both kernels of the attention
dispatch when its scores are not capped: ``attend_prefill`` (a prefill pass whose whole KV
is resident) and ``attend_slots`` (a decode query over chunks attended in the host pool).
With the cap on, neither is called, torch's path applies the cap, and the greedy tokens
equal transformers' eager attention with its ``DynamicCache``.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

import pytest
import torch
from transformers import DynamicCache

from kvtier import native
from kvtier.config import TieredCacheConfig
from kvtier.hf import TieredCache
from kvtier.kv import KVLayout
from kvtier.models import random_model

CHUNK = 16
PROMPT_TOKENS = 100
GREEDY = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)


class _Recorder:
    """``torch.ops.kvtier_cpu`` that counts the calls of each operator."""

    def __init__(self, ops: Any) -> None:
        self.ops = ops
        self.calls: Counter[str] = Counter()

    def __getattr__(self, name: str) -> Any:
        op = getattr(self.ops, name)

        def call(*args: Any) -> Any:
            self.calls[name] += 1
            return op(*args)

        return call


def _gemma2(cap: float | None) -> Any:
    # Head size 64: the kernels' size. The window (4096) covers the context: full layers.
    return random_model(
        "gemma2", seed=3, head_dim=64, attention_gain=30, attn_logit_softcapping=cap
    )


def _config(model: Any, chunks: int, placement: str) -> TieredCacheConfig:
    layout = KVLayout.from_model_config(model.config, torch.float32, CHUNK)
    config = TieredCacheConfig(
        device_budget_bytes=chunks * layout.chunk_nbytes, staging_bytes=2 * layout.layer_nbytes
    )
    return dataclasses.replace(config, placement=placement)


@pytest.mark.parametrize(
    ("chunks", "placement", "kernel"),
    [(64, "stream", "attend_prefill"), (2, "host", "attend_slots")],
    ids=["resident-prefill", "decode-on-host"],
)
def test_capped_layers_skip_the_kernels_and_equal_eager(
    chunks: int, placement: str, kernel: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    ops = native.ops()
    if ops is None:
        pytest.skip(f"kvtier's CPU kernels unavailable: {native.status().reason}")
    recorder = _Recorder(ops)
    monkeypatch.setattr(native, "ops", lambda: recorder)
    ids = torch.randint(3, 256, (1, PROMPT_TOKENS), generator=torch.Generator().manual_seed(4))
    tokens: dict[float | None, torch.Tensor] = {}
    for cap in (None, 2.0):
        model = _gemma2(cap)
        with torch.no_grad():
            expected = model.generate(ids, cache=DynamicCache(config=model.config), **GREEDY)
            recorder.calls.clear()
            cache = TieredCache(model, _config(model, chunks, placement), chunk_tokens=CHUNK)
            got = model.generate(ids, cache=cache, **GREEDY)
        assert torch.equal(got, expected)
        # Uncapped, the kernel runs (the setup reaches it); capped, torch's path does.
        assert (recorder.calls[kernel] > 0) == (cap is None), recorder.calls
        tokens[cap] = expected
    assert not torch.equal(tokens[None], tokens[2.0])  # the cap changes the tokens
