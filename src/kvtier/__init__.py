"""kvtier: a tiered KV-cache engine for LLM inference.

The KV cache of long contexts and many sessions is split into immutable, content-addressed
chunks that live in a budgeted device tier, a host DRAM pool, a disk store and (later) a
shared remote store; links move chunks between adjacent tiers beside compute.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "__version__"]

# Loaded on first use, so `import kvtier` stays light (no torch or transformers).
_LAZY = {"LLM": "kvtier.engine.llm", "SamplingParams": "kvtier.engine.request"}


def __getattr__(name: str) -> object:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kvtier' has no attribute {name!r}")
