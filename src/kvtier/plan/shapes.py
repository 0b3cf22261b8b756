"""A model's size as the planner needs it: ``ModelShape`` and ``model_shape``.

Only the dimensions matter (weights are never loaded): parameter count and weight bytes,
KV bytes per token, and FLOPs per token. ``model_shape`` reads an HF config folder, the
embedded model, or a preset of ``kvtier.random_weights.SHAPES`` (and a few more common
models). Pure functions; thread-safe.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.random_weights import SHAPES

EXTRA_PRESETS: dict[str, dict[str, Any]] = {
    "llama3-70b": {
        "vocab_size": 128256,
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 128,
    },
    "qwen2.5-7b": {
        "vocab_size": 152064,
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "head_dim": 128,
    },
}
"""Shapes beyond ``SHAPES`` (published configs' dimensions)."""

PRESETS = {**{k: v for k, v in SHAPES.items() if k != "tiny"}, **EXTRA_PRESETS}


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer's dimensions and the sizes that follow from them."""

    name: str
    num_layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    dtype_bytes: int

    @property
    def params(self) -> int:
        """Parameters (projections, MLP, norms, embeddings, the LM head unless tied)."""
        attention = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        layer = attention + 3 * self.hidden * self.intermediate + 2 * self.hidden
        head = 0 if self.tied else self.vocab * self.hidden
        return self.num_layers * layer + self.vocab * self.hidden + head + self.hidden

    @property
    def weight_bytes(self) -> int:
        return self.params * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.kv_heads * self.head_dim * self.dtype_bytes

    @property
    def flops_per_token(self) -> float:
        """Matmul FLOPs of one token through every projection and the LM head."""
        return 2.0 * (self.params - self.vocab * self.hidden * (0 if self.tied else 1))

    @property
    def attention_flops_per_token_pair(self) -> float:
        """FLOPs of one query token attending to one key (scores and values, all layers)."""
        return 4.0 * self.num_layers * self.heads * self.head_dim


def from_config(name: str, config: dict[str, Any], dtype_bytes: int) -> ModelShape:
    """The shape of an HF-style config dict (``head_dim`` defaults to hidden ÷ heads)."""
    text = config.get("text_config", config)
    heads = int(text["num_attention_heads"])
    hidden = int(text["hidden_size"])
    return ModelShape(
        name=name,
        num_layers=int(text["num_hidden_layers"]),
        hidden=hidden,
        intermediate=int(text["intermediate_size"]),
        heads=heads,
        kv_heads=int(text.get("num_key_value_heads") or heads),
        head_dim=int(text.get("head_dim") or hidden // heads),
        vocab=int(text["vocab_size"]),
        tied=bool(text.get("tie_word_embeddings", False)),
        dtype_bytes=dtype_bytes,
    )


def model_shape(spec: str | None, dtype_bytes: int = 2) -> ModelShape:
    """``spec``: a preset name (``PRESETS``), an HF folder with ``config.json``, or None /
    ``embedded`` (the embedded SmolLM2-135M's dimensions).

    Raises:
        ValueError: neither a preset nor a folder with a config.
    """
    if spec is None or spec == "embedded":
        spec = "smollm2-135m"
    if spec in PRESETS:
        return from_config(spec, PRESETS[spec], dtype_bytes)
    path = Path(spec) / "config.json"
    if not path.is_file():
        raise ValueError(
            f"--model: {spec!r} is neither a preset ({', '.join(sorted(PRESETS))}) nor a "
            "folder with a config.json"
        )
    return from_config(Path(spec).name, json.loads(path.read_text()), dtype_bytes)
