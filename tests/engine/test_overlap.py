"""Reuse from a slow disk: the engine computes a prefix's front while its back loads and
adopts the back where they meet (``kvtier.engine.overlap``); or, when the disk is fast,
loads it all first. Greedy tokens must equal transformers ``generate`` either way."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from kvtier.config import LinkConfig
from kvtier.engine import Engine, EngineConfig, SamplingParams
from kvtier.kv import KVLayout
from kvtier.models import model_config
from tests.engine.tiny import CHUNK, engine_config, reference_tokens

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
CHUNKS = 20
PROMPT = list(range(300, 300 + CHUNKS * CHUNK + 5))


def chunk_nbytes() -> int:
    return KVLayout.from_model_config(model_config("llama"), torch.float32, CHUNK).chunk_nbytes


def disk_at(config: EngineConfig, seconds_per_chunk: float) -> EngineConfig:
    """``config`` with its disk link throttled to one chunk per ``seconds_per_chunk``."""
    (disk,) = config.manager.lower_tiers
    link = LinkConfig(gbps=chunk_nbytes() / seconds_per_chunk / 1e9)
    manager = dataclasses.replace(
        config.manager, lower_tiers=(dataclasses.replace(disk, link=link),)
    )
    return dataclasses.replace(config, manager=manager)


def served_once(model: Any, tokenizer: Any, disk: str) -> list[int]:
    """Serve ``PROMPT`` once; its chunks are on disk when the engine has closed."""
    with Engine(model, tokenizer, engine_config(disk_dir=disk)) as engine:
        return engine.submit(PROMPT, GREEDY).result().token_ids


def test_a_slow_disk_computes_the_front_while_the_back_loads(
    model: Any, tokenizer: Any, tmp_path: Path
) -> None:
    disk = str(tmp_path / "kv")
    first = served_once(model, tokenizer, disk)
    # 50 ms a chunk: the back of 20 chunks would take a second to load.
    with Engine(model, tokenizer, disk_at(engine_config(disk_dir=disk), 0.05)) as engine:
        out = engine.submit(PROMPT, GREEDY).result()
        stats = engine.stats()
    assert out.token_ids == first == reference_tokens(model, PROMPT, GREEDY.max_tokens)
    decisions = stats.reuse_decisions
    load, recompute = decisions["load"], decisions["recompute"]
    assert load.chunks >= 1 and recompute.chunks >= 1  # they met inside the prefix
    assert load.chunks + recompute.chunks <= CHUNKS
    assert out.reused_tokens == load.chunks * CHUNK
    assert stats.reused_tokens_by_tier == {"disk": load.chunks * CHUNK}
    assert load.predicted_s is not None and recompute.predicted_s is not None
    assert load.measured_s is not None and load.measured_s > 0
    assert load.nbytes == load.chunks * chunk_nbytes()


def test_a_fast_disk_loads_the_whole_prefix_first(
    model: Any, tokenizer: Any, tmp_path: Path
) -> None:
    disk = str(tmp_path / "kv")
    first = served_once(model, tokenizer, disk)
    with Engine(model, tokenizer, disk_at(engine_config(disk_dir=disk), 1e-6)) as engine:
        out = engine.submit(PROMPT, GREEDY).result()
        stats = engine.stats()
    assert out.token_ids == first
    assert set(stats.reuse_decisions) == {"load"}
    assert stats.reuse_decisions["load"].chunks == CHUNKS
    assert out.reused_tokens >= CHUNKS * CHUNK  # and the partial chunk's pages
