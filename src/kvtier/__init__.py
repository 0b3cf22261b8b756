"""kvtier: a tiered KV-cache engine for LLM inference.

The KV cache of long contexts and many sessions is split into immutable, content-addressed
chunks that live in a budgeted device tier, a host DRAM pool, a disk store and (later) a
shared remote store; links move chunks between adjacent tiers beside compute.
"""

from __future__ import annotations

__version__ = "0.1.0"
