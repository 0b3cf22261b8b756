"""The byte layout of one model's KV cache, chunked along the sequence.

A chunk holds the KV of ``chunk_tokens`` consecutive tokens for every layer of one
sequence, as one contiguous buffer::

    [num_layers, 2 (k, v), num_kv_heads, chunk_tokens, head_dim]

The inner ``[H, S, D]`` order is what transformers' attention reads (``[B, H, S, D]``), one
layer's slice is contiguous (layer-wise loading) and the whole chunk is one buffer (disk and
network I/O move it in one piece).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


def dtype_name(dtype: torch.dtype) -> str:
    """The short name of a supported KV dtype (``float32``, ``float16``, ``bfloat16``)."""
    for name, value in DTYPES.items():
        if value == dtype:
            return name
    raise ValueError(f"dtype: {dtype} is not a supported KV dtype; accepted: {sorted(DTYPES)}")


@dataclass(frozen=True)
class KVLayout:
    """Shape and byte sizes of a model's chunked KV cache.

    Attributes:
        num_layers: decoder layers that keep KV.
        num_kv_heads: key/value heads per layer (after grouped-query sharing).
        head_dim: size of one head.
        dtype: element type of K and V.
        chunk_tokens: tokens per chunk (default 256).
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.float32
    chunk_tokens: int = 256

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "chunk_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: must be an integer >= 1, got {value!r}")
        dtype_name(self.dtype)

    @classmethod
    def from_model_config(
        cls, config: Any, dtype: torch.dtype = torch.float32, chunk_tokens: int = 256
    ) -> KVLayout:
        """The layout of a transformers ``PretrainedConfig`` (decoder part)."""
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        num_heads = int(text.num_attention_heads)
        num_kv_heads = int(getattr(text, "num_key_value_heads", None) or num_heads)
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // num_heads
        return cls(
            num_layers=int(text.num_hidden_layers),
            num_kv_heads=num_kv_heads,
            head_dim=int(head_dim),
            dtype=dtype,
            chunk_tokens=chunk_tokens,
        )

    def prefix_limit(self, num_tokens: int) -> int:
        """The most tokens of a ``num_tokens`` prompt a prefix hit can cover: whole chunks,
        leaving at least the last token to compute (the model needs it for the logits)."""
        return ((num_tokens - 1) // self.chunk_tokens) * self.chunk_tokens

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def chunk_shape(self) -> tuple[int, int, int, int, int]:
        """``[layers, 2, kv_heads, chunk_tokens, head_dim]``."""
        return (self.num_layers, 2, self.num_kv_heads, self.chunk_tokens, self.head_dim)

    @property
    def token_nbytes(self) -> int:
        """Bytes of KV per token over all layers (K and V)."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * self.itemsize

    @property
    def layer_nbytes(self) -> int:
        """Bytes of one layer's slice (K and V) of one chunk."""
        return 2 * self.num_kv_heads * self.chunk_tokens * self.head_dim * self.itemsize

    @property
    def chunk_nbytes(self) -> int:
        """Bytes of one whole chunk."""
        return self.num_layers * self.layer_nbytes

    def kv_nbytes(self, num_tokens: int) -> int:
        """Bytes of KV for ``num_tokens`` tokens of one sequence."""
        return num_tokens * self.token_nbytes

    def fingerprint(self) -> str:
        """A stable string naming everything that changes the bytes of a chunk."""
        return (
            f"L{self.num_layers}.H{self.num_kv_heads}.D{self.head_dim}."
            f"{dtype_name(self.dtype)}.T{self.chunk_tokens}.lkhsd"
        )

    def empty_chunk(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """A new uninitialised chunk tensor (for tests and staging, not for pools)."""
        return torch.empty(self.chunk_shape, dtype=self.dtype, device=device)
