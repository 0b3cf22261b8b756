"""Hugging Face transformers integration: ``TieredCache`` and kvtier's attention."""

from __future__ import annotations

from kvtier.hf.attention import ATTENTION_NAME, attach, register
from kvtier.hf.cache import CacheStats, LayerView, TieredCache

__all__ = ["ATTENTION_NAME", "CacheStats", "LayerView", "TieredCache", "attach", "register"]
