"""``LLM``: offline batch generation through the engine.

from kvtier import LLM, SamplingParams

with LLM() as llm:  # the embedded SmolLM2-135M-Instruct
    for out in llm.generate(["The capital of France is"], SamplingParams(temperature=0)):
        print(out.text)
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Sequence
from typing import Any

import torch

from kvtier.engine.config import EngineConfig
from kvtier.engine.engine import Engine
from kvtier.engine.request import Completion, QueueFullError, RequestHandle, SamplingParams


class LLM:
    """Generate completions for many prompts at once, with prefix reuse across them.

    Args:
        model: a model folder or ``.gguf`` file, None for the embedded model, or an
            already loaded transformers model (then pass ``tokenizer``).
        tokenizer: the tokenizer of a loaded ``model``.
        config: the engine's configuration (tiers, budgets, queue).
        dtype: weight dtype when loading.
        device: where to load the weights (default: CPU).
    """

    def __init__(
        self,
        model: str | os.PathLike[str] | torch.nn.Module | None = None,
        *,
        tokenizer: Any = None,
        config: EngineConfig | None = None,
        dtype: torch.dtype = torch.float32,
        device: str | None = None,
    ) -> None:
        if isinstance(model, torch.nn.Module):
            if tokenizer is None:
                raise ValueError("tokenizer: required when model is a loaded model")
            self.engine = Engine(model, tokenizer, config)
        else:
            path = None if model is None else os.fspath(model)
            self.engine = Engine.from_pretrained(path, config, dtype=dtype, device=device)

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[Completion]:
        """Completions for ``prompts`` (texts, or token-id lists), in the same order.

        ``params`` is one ``SamplingParams`` for all prompts or one per prompt. Blocks
        until every prompt is done; when the engine's queue is full, waits for the oldest
        outstanding prompt before submitting more.
        """
        items: list[str | Sequence[int]] = [prompts] if isinstance(prompts, str) else list(prompts)
        if items and isinstance(items[0], int):
            raise TypeError("prompts: pass a list of prompts (texts or token-id lists)")
        if params is None or isinstance(params, SamplingParams):
            per_prompt = [params or SamplingParams()] * len(items)
        else:
            per_prompt = list(params)
            if len(per_prompt) != len(items):
                raise ValueError(
                    f"params: got {len(per_prompt)} for {len(items)} prompts; pass one or "
                    "one per prompt"
                )
        handles: list[RequestHandle] = []
        outstanding: deque[RequestHandle] = deque()
        results: dict[str, Completion] = {}
        for prompt, prompt_params in zip(items, per_prompt, strict=True):
            while True:
                try:
                    handle = self.engine.submit(prompt, prompt_params)
                    break
                except QueueFullError:
                    oldest = outstanding.popleft()
                    results[oldest.request_id] = oldest.result()
            handles.append(handle)
            outstanding.append(handle)
        for handle in outstanding:
            results[handle.request_id] = handle.result()
        return [results[h.request_id] for h in handles]

    def close(self) -> None:
        """Finish outstanding work and release the tiers (see ``Engine.close``)."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
