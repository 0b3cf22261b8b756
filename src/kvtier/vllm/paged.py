"""Between vLLM's paged KV and kvtier chunks: ``PagedLayout``, ``gather_chunk``, ``scatter_layer``.

vLLM's CPU attention backend keeps one tensor per attention layer::

    memory  [num_blocks, kv_heads, block_size, 2 * head_dim]
    read as [num_blocks, kv_heads, 2 * block_size, head_dim]   K: rows [0, block_size)
                                                               V: rows [block_size, 2 * block_size)

so one block of one head holds its ``block_size`` keys, then its ``block_size`` values, each
token's row contiguous. A kvtier chunk is ``[layers, 2, kv_heads, chunk_tokens, head_dim]``;
with ``chunk_tokens = n * block_size`` chunk ``c`` of a request is the ``n`` blocks
``block_table[c * n : (c + 1) * n]``, laid side by side along the token axis.

Pure tensor functions: they read or write only the tensors they are given, and the caller
makes sure no forward uses the blocks they write (vLLM's connector contract: a load
finishes before the layer's attention runs; a save reads blocks of the step that just ran).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvtier.kv.layout import KVLayout


class UnsupportedPagingError(ValueError):
    """vLLM's KV cache has a layout kvtier cannot gather (one line: which, and why)."""


@dataclass(frozen=True)
class PagedLayout:
    """How vLLM pages one model's KV, checked against kvtier's chunk layout.

    Attributes:
        layout: kvtier's chunk layout of the same model.
        block_size: tokens per vLLM block.
    """

    layout: KVLayout
    block_size: int

    def __post_init__(self) -> None:
        if self.layout.chunk_tokens % self.block_size:
            raise UnsupportedPagingError(
                f"chunk_tokens: {self.layout.chunk_tokens} is not a multiple of vLLM's block "
                f"size {self.block_size}; set chunk_tokens to a multiple of it"
            )

    @property
    def blocks_per_chunk(self) -> int:
        return self.layout.chunk_tokens // self.block_size

    def check(self, name: str, kv_layer: torch.Tensor) -> None:
        """Raise ``UnsupportedPagingError`` unless ``kv_layer`` is a CPU-backend layer of
        this model: ``[num_blocks, kv_heads, block_size, 2 * head_dim]`` in the KV dtype."""
        lay = self.layout
        want = (lay.num_kv_heads, self.block_size, 2 * lay.head_dim)
        if kv_layer.dim() != 4 or tuple(kv_layer.shape[1:]) != want:
            raise UnsupportedPagingError(
                f"layer {name}: vLLM's KV cache has shape {tuple(kv_layer.shape)}; kvtier's "
                f"connector reads the CPU backend's [blocks, {want[0]}, {want[1]}, {want[2]}] "
                "(other attention backends are not supported yet)"
            )
        if kv_layer.dtype != lay.dtype or not kv_layer.is_contiguous():
            raise UnsupportedPagingError(
                f"layer {name}: KV dtype {kv_layer.dtype} (contiguous: "
                f"{kv_layer.is_contiguous()}); kvtier expects contiguous {lay.dtype} "
                "(the model's dtype; a quantised kv_cache_dtype is not supported)"
            )

    def blocks(self, kv_layer: torch.Tensor) -> torch.Tensor:
        """``kv_layer`` as ``[num_blocks, kv_heads, 2 (k, v), block_size, head_dim]`` (a view)."""
        num_blocks = kv_layer.shape[0]
        lay = self.layout
        return kv_layer.view(num_blocks, lay.num_kv_heads, 2, self.block_size, lay.head_dim)


def gather_chunk(
    paged: PagedLayout,
    kv_layers: Sequence[torch.Tensor],
    block_ids: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """Copy one chunk's blocks of every layer into ``out [L, 2, H, T, D]``.

    ``block_ids``: the chunk's ``blocks_per_chunk`` block ids, in token order (int64).
    Mutates ``out`` only.
    """
    lay, n = paged.layout, paged.blocks_per_chunk
    # [2, H, n, bs, D] view of each layer's slice of the chunk
    shaped = out.view(lay.num_layers, 2, lay.num_kv_heads, n, paged.block_size, lay.head_dim)
    for layer, kv_layer in enumerate(kv_layers):
        picked = paged.blocks(kv_layer).index_select(0, block_ids)  # [n, H, 2, bs, D]
        shaped[layer].copy_(picked.permute(2, 1, 0, 3, 4))


def scatter_layer(
    paged: PagedLayout,
    chunk_layer: torch.Tensor,
    kv_layer: torch.Tensor,
    block_ids: torch.Tensor,
    first_block: int = 0,
) -> None:
    """Copy one layer of a chunk, ``chunk_layer [2, H, T, D]``, into its blocks.

    ``block_ids``: the blocks that receive the chunk's blocks ``first_block, first_block +
    1, …`` (blocks before ``first_block`` are already computed and are not written).
    Mutates ``kv_layer`` (those blocks) only.
    """
    lay, n = paged.layout, paged.blocks_per_chunk
    src = chunk_layer.view(2, lay.num_kv_heads, n, paged.block_size, lay.head_dim)
    src = src.permute(2, 1, 0, 3, 4)[first_block:]  # [m, H, 2, bs, D]
    paged.blocks(kv_layer).index_copy_(0, block_ids, src.contiguous())
