"""One Llama-family decoder layer's weights as kvtier's forward holds them, and the
argument lists ``kvtier_cpu::decode_layers`` takes.

``fuse_layer`` concatenates q/k/v and gate/up once (the other weights are the loaded
model's, shared, not copied) and makes each projection a ``Linear`` (oneDNN's packed copy
and, with kvtier's kernels, its panels). ``decode_arguments`` lists, per layer, the norms
and panels ``decode_layers`` reads, or None where that op cannot run the model.

Both only read the model; the ``Linear`` copies they make are owned by the caller.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvtier.engine.linear import Linear, make_linear


@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer's weights."""

    input_norm: torch.Tensor  # [H]
    qkv: Linear  # [(Hq + 2 Hkv) * D, H]
    q_norm: torch.Tensor | None  # [D] (Qwen3)
    k_norm: torch.Tensor | None
    o: Linear  # [H, Hq * D]
    post_norm: torch.Tensor  # [H]
    gate_up: Linear  # [2 I, H]
    down: Linear  # [H, I]

    def projections(self) -> tuple[Linear, Linear, Linear, Linear]:
        """q/k/v, o, gate/up and down, in a step's order."""
        return (self.qkv, self.o, self.gate_up, self.down)


def _cat(parts: Sequence[torch.Tensor | None]) -> torch.Tensor | None:
    """Concatenate biases along the output dim; None when every part has none."""
    if all(p is None for p in parts):
        return None
    if any(p is None for p in parts):
        raise ValueError("a fused projection mixes parts with and without bias")
    return torch.cat([p for p in parts if p is not None])


def fuse_layer(layer: Any, ops: Any, matmul_dtype: torch.dtype | None) -> LayerWeights:
    """``layer`` (a transformers decoder layer of the Llama shape) with q/k/v and gate/up
    fused; ``ops``: kvtier's CPU kernels or None; ``matmul_dtype``: ``make_linear``'s.

    Raises:
        ValueError: a fused projection mixes parts with and without bias.
    """
    attn, mlp = layer.self_attn, layer.mlp
    q_norm = getattr(attn, "q_norm", None)
    k_norm = getattr(attn, "k_norm", None)
    qkv = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
    gate_up = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])
    low = matmul_dtype
    qkv_bias = _cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias])
    return LayerWeights(
        input_norm=layer.input_layernorm.weight,
        qkv=make_linear(qkv, qkv_bias, ops, low),
        q_norm=q_norm.weight if q_norm is not None else None,
        k_norm=k_norm.weight if k_norm is not None else None,
        o=make_linear(attn.o_proj.weight, attn.o_proj.bias, ops, low),
        post_norm=layer.post_attention_layernorm.weight,
        gate_up=make_linear(gate_up, _cat([mlp.gate_proj.bias, mlp.up_proj.bias]), ops, low),
        down=make_linear(mlp.down_proj.weight, mlp.down_proj.bias, ops, low),
    )


def decode_arguments(
    layers: Sequence[LayerWeights], coded: bool = False
) -> tuple[list[torch.Tensor], list[torch.Tensor | None]] | None:
    """``decode_layers``' weights (6 a layer: input norm, qkv, o panels, post norm, gate/up,
    down panels; with ``coded``, each projection's code panels where it has them) and
    biases (4 a layer), or None: a projection without panels (no kernels), or Qwen3's
    per-head norms (the op does not run them)."""
    weights: list[torch.Tensor] = []
    biases: list[torch.Tensor | None] = []
    for layer in layers:
        projections = layer.projections()
        chosen = [x.codes if coded and x.codes is not None else x.panels for x in projections]
        panels = [p for p in chosen if p is not None]
        if len(panels) < 4 or layer.q_norm is not None:
            return None
        qkv, o, gate_up, down = panels
        weights += [layer.input_norm, qkv, o, layer.post_norm, gate_up, down]
        biases += [x.bias for x in projections]
    return weights, biases
