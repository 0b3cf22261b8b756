"""The serving engine: requests, sampling, the engine's worker, and ``LLM`` for batches."""

from __future__ import annotations

from kvtier.engine.config import EngineConfig
from kvtier.engine.engine import Engine
from kvtier.engine.llm import LLM
from kvtier.engine.request import (
    Completion,
    ContextLengthError,
    EngineClosedError,
    FinishReason,
    ParamError,
    QueueFullError,
    Request,
    RequestHandle,
    SamplingParams,
    TokenEvent,
    TokenLogprobs,
)
from kvtier.engine.stats import EngineStats, HistogramSnapshot

__all__ = [
    "LLM",
    "Completion",
    "ContextLengthError",
    "Engine",
    "EngineClosedError",
    "EngineConfig",
    "EngineStats",
    "FinishReason",
    "HistogramSnapshot",
    "ParamError",
    "QueueFullError",
    "Request",
    "RequestHandle",
    "SamplingParams",
    "TokenEvent",
    "TokenLogprobs",
]
