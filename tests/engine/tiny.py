"""A tiny random-weight llama with the embedded model's tokenizer, and engine configs for it.

The tokenizer is the embedded SmolLM2's (real text, real chat template, valid ids); the
weights are random and tiny, so generation runs in milliseconds per token on a CPU.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoTokenizer, DynamicCache

from kvtier.config import DiskConfig, HostConfig, ManagerConfig, TieredCacheConfig
from kvtier.engine import EngineConfig
from kvtier.kv import KVLayout
from kvtier.models import (
    ModelLoadError,
    converted_folder,
    embedded_gguf_path,
    load_model,
    model_config,
    random_model,
)

CHUNK = 16


@functools.cache
def embedded_tokenizer() -> Any:
    """The embedded model's tokenizer (from its converted folder; converts it if needed)."""
    try:
        folder = converted_folder(embedded_gguf_path())
        if (folder / "tokenizer.json").is_file():
            return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        return load_model().tokenizer
    except ModelLoadError as exc:
        pytest.skip(f"embedded model unavailable: {exc}")


def tiny_model(tokenizer: Any, seed: int = 0) -> Any:
    return random_model("llama", seed=seed, vocab_size=len(tokenizer))


def save_folder(folder: Path, tokenizer: Any, model: Any = None) -> Path:
    """An HF model folder (``kvtier serve --model`` loads it): ``model`` (default: the tiny
    llama) with ``tokenizer``."""
    (model if model is not None else tiny_model(tokenizer)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def engine_config(
    max_queued: int = 64,
    disk_dir: str | None = None,
    host_chunks: int = 512,
    max_batch_size: int = 4,
) -> EngineConfig:
    """Small tiers in 16-token chunks: an 8-chunk device budget per sequence, a host pool,
    maybe disk; continuous batching of ``max_batch_size`` sequences (1: one at a time)."""
    shape = model_config("llama")  # the tiny shape; the layout does not depend on the vocabulary
    chunk_nbytes = KVLayout.from_model_config(shape, torch.float32, CHUNK).chunk_nbytes
    return EngineConfig(
        max_queued=max_queued,
        max_batch_size=max_batch_size,
        cache=TieredCacheConfig(
            device_budget_bytes=8 * chunk_nbytes, staging_bytes=4 * chunk_nbytes
        ),
        manager=ManagerConfig(
            chunk_tokens=CHUNK,
            host=HostConfig(capacity_bytes=host_chunks * chunk_nbytes),
            lower_tiers=(DiskConfig(path=disk_dir, fsync=False),) if disk_dir is not None else (),
        ),
    )


def with_remote(config: EngineConfig, url: str, prefix: str | None = None) -> EngineConfig:
    """``config`` with the shared tier on the Redis at ``url`` below its other tiers, under
    its own key prefix (default: a new one), with a timeout no loaded machine reaches (the
    fault tests set their own)."""
    import dataclasses
    import uuid

    from kvtier.config import RemoteConfig

    prefix = prefix or f"test{uuid.uuid4().hex[:12]}"
    remote = RemoteConfig(url=url, key_prefix=prefix, cluster=True, timeout_s=5.0)  # not a fault
    tiers = (*config.manager.lower_tiers, remote)
    return dataclasses.replace(
        config, manager=dataclasses.replace(config.manager, lower_tiers=tiers)
    )


def record_one_call_steps(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Patch ``LlamaModel._decode_layers`` to note the row count of every decode step it
    runs in one call (then runs it); the list fills as the engine steps."""
    from kvtier.engine.llama import LlamaModel

    rows: list[int] = []
    original = LlamaModel._decode_layers

    def recording(self: LlamaModel, ops: Any, h: torch.Tensor, *args: Any) -> None:
        rows.append(h.shape[0])
        original(self, ops, h, *args)

    monkeypatch.setattr(LlamaModel, "_decode_layers", recording)
    return rows


def reference_tokens(model: Any, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy tokens from transformers ``generate`` with its own ``DynamicCache``."""
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            cache=DynamicCache(config=model.config),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    return list(out[0, len(prompt_ids) :].tolist())


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    """The embedded model's tokenizer (shared by the engine and server tests)."""
    return embedded_tokenizer()


@pytest.fixture(scope="module")
def model(tokenizer: Any) -> Any:
    """A tiny random-weight Llama over that tokenizer's vocabulary."""
    return tiny_model(tokenizer)


FAULT_TOKEN = 4242  # a prompt holding this id makes ``inject_fault``'s model raise


def inject_fault(monkeypatch: pytest.MonkeyPatch, model: Any) -> None:
    """Fault injection: ``model``'s input embedding raises ``RuntimeError("injected
    fault")`` for any input that holds ``FAULT_TOKEN`` (for the rest of the test). Every
    runner's forward embeds its ids first (transformers' and kvtier's own)."""
    embeddings = model.get_input_embeddings()
    forward = embeddings.forward

    def faulty(*args: Any, **kwargs: Any) -> Any:
        ids = args[0] if args else kwargs.get("input")
        if isinstance(ids, torch.Tensor) and bool((ids == FAULT_TOKEN).any()):
            raise RuntimeError("injected fault")
        return forward(*args, **kwargs)

    monkeypatch.setattr(embeddings, "forward", faulty)
