"""Hugging Face transformers integration: the thin adapter over ``kvtier.runtime``.

``TieredCache`` (the drop-in ``Cache``), ``PackedCache`` (several sequences packed in one
row, for the engine), ``attach`` (kvtier's attention and the forward hooks) and the
generate helpers in ``kvtier.hf.generate``.
"""

from __future__ import annotations

from kvtier.hf.attention import ATTENTION_NAME, attach, register
from kvtier.hf.cache import ModelSpec, TieredCache, model_spec
from kvtier.hf.packed import PackedCache, begin_packed

__all__ = [
    "ATTENTION_NAME",
    "ModelSpec",
    "PackedCache",
    "TieredCache",
    "attach",
    "begin_packed",
    "model_spec",
    "register",
]
