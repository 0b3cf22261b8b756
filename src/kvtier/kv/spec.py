"""Per-layer KV specs of a model, and whether kvtier can run it exactly.

kvtier attends every layer with scaled softmax attention through transformers'
``AttentionInterface``: over the sequence's whole history, or over the last W tokens on
sliding-window layers, with the scores soft-capped where the modelling asks for it
(Gemma 2's ``attn_logit_softcapping``: ``c · tanh(s / c)`` per score, applied by
``kvtier.attention``). A model whose layers attend otherwise would get silently different
tokens, so it is refused when its cache is built, with one line naming the model type and
the reason:

| what the model has | why it is refused |
| --- | --- |
| other kinds in ``layer_types`` (chunked, linear, …) | not implemented |
| learned attention sinks | a sink logit joins every softmax |
| no ``AttentionInterface``, encoder-decoder | kvtier's attention is not called |
| modules whose KV heads or head size disagree | the layout would be wrong |

A window at least as long as the context (``max_position_embeddings``) never drops a key,
so such layers run as full attention. Pure functions of the model; they mutate nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

FULL = "full_attention"
SLIDING = "sliding_attention"


class UnsupportedModelError(ValueError):
    """kvtier cannot run this model exactly; the message is one line with the reason."""


@dataclass(frozen=True)
class LayerSpec:
    """What one attention layer keeps.

    Attributes:
        layer_idx: the layer.
        attention: ``"full_attention"``, ``"sliding_attention"`` or another kind named by
            the config's ``layer_types``.
        window: the sliding window in tokens (None: the whole history).
        num_kv_heads: KV heads of the layer's module (None when it has no ``k_proj``).
        head_dim: the module's head size (None when it does not say).
    """

    layer_idx: int
    attention: str
    window: int | None
    num_kv_heads: int | None
    head_dim: int | None


def _text_config(model: Any) -> Any:
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _attention_modules(model: Any) -> dict[int, torch.nn.Module]:
    """The attention module of each layer, by ``layer_idx`` (the first module that has one
    and projects keys)."""
    found: dict[int, torch.nn.Module] = {}
    for module in model.modules():
        idx = getattr(module, "layer_idx", None)
        if (
            isinstance(idx, int)
            and idx not in found
            and type(module).__name__.endswith("Attention")
        ):
            found[idx] = module
    return found


def layer_specs(model: Any) -> list[LayerSpec]:
    """The spec of every decoder layer, from the config and the attention modules."""
    text = _text_config(model)
    layers = int(text.num_hidden_layers)
    types = getattr(text, "layer_types", None) or [FULL] * layers
    config_window = getattr(text, "sliding_window", None)
    modules = _attention_modules(model)
    specs: list[LayerSpec] = []
    for i in range(layers):
        kind = types[i] if i < len(types) else FULL
        module = modules.get(i)
        window = getattr(module, "sliding_window", None) if module is not None else None
        if getattr(text, "layer_types", None) is None and config_window is not None:
            kind, window = SLIDING, config_window  # every layer (Mistral, Starcoder2, Phi-3)
        elif kind == SLIDING and window is None:
            window = config_window
        head_dim = getattr(module, "head_dim", None)
        k_proj = getattr(module, "k_proj", None)
        kv_heads = None
        if isinstance(k_proj, torch.nn.Linear) and isinstance(head_dim, int) and head_dim:
            kv_heads = k_proj.out_features // head_dim
        specs.append(
            LayerSpec(
                i,
                kind,
                int(window) if window is not None else None,
                kv_heads,
                head_dim if isinstance(head_dim, int) else None,
            )
        )
    return specs


def _layers(indices: list[int]) -> str:
    shown = ", ".join(str(i) for i in indices[:6])
    if len(indices) == 1:
        return f"layer {shown} attends"
    return f"layers {shown}{'…' if len(indices) > 6 else ''} attend"


def check_exact(model: Any, num_kv_heads: int, head_dim: int) -> list[LayerSpec]:
    """The model's layer specs, once it is known kvtier runs it exactly.

    Args:
        model: the causal LM.
        num_kv_heads: KV heads the cache's layout holds per layer.
        head_dim: the layout's head size.

    Raises:
        UnsupportedModelError: one line naming the model type and the reason.
    """
    text = _text_config(model)
    model_type = getattr(text, "model_type", type(model).__name__)

    def refuse(reason: str) -> UnsupportedModelError:
        return UnsupportedModelError(
            f"kvtier cannot run {model_type} exactly: {reason}; use transformers' own cache "
            "for this model"
        )

    if getattr(model.config, "is_encoder_decoder", False):
        raise refuse("it is an encoder-decoder model")
    can_set = getattr(type(model), "_can_set_attn_implementation", None)
    if callable(can_set) and not can_set():  # transformers' own test of its modelling code
        raise refuse("its attention does not go through transformers' AttentionInterface")
    specs = layer_specs(model)
    other = [s for s in specs if s.attention not in (FULL, SLIDING)]
    if other:
        kinds = sorted({s.attention for s in other})
        raise refuse(f"{_layers([s.layer_idx for s in other])} with {', '.join(kinds)}")
    modules = _attention_modules(model)
    if any(getattr(m, "sinks", None) is not None for m in modules.values()):
        raise refuse("its attention has learned sinks")
    for spec in specs:
        if (spec.num_kv_heads, spec.head_dim) != (None, None) and (
            (spec.num_kv_heads is not None and spec.num_kv_heads != num_kv_heads)
            or (spec.head_dim is not None and spec.head_dim != head_dim)
        ):
            raise UnsupportedModelError(
                f"{model_type}: layer {spec.layer_idx}'s attention module has "
                f"{spec.num_kv_heads} KV heads of size {spec.head_dim}, but the config says "
                f"{num_kv_heads} of size {head_dim} (num_key_value_heads, head_dim); fix the "
                "config so it describes the modules"
            )
    return specs


def sliding_windows(model: Any, specs: list[LayerSpec]) -> list[int | None]:
    """Per layer, the window its attention must keep to; None where it sees the whole
    history (full attention, or a window no shorter than the context)."""
    context = int(getattr(_text_config(model), "max_position_embeddings", 0) or 0)
    return [
        s.window if s.window is not None and (not context or s.window < context) else None
        for s in specs
    ]


def check_update(
    model_type: str, layer_idx: int, key_states: torch.Tensor, num_kv_heads: int, head_dim: int
) -> None:
    """Refuse a layer's new keys ``[B, H, S, D]`` that do not match the cache's layout.

    Raises:
        UnsupportedModelError: naming the model type, the layer and both shapes.
    """
    if key_states.dim() != 4 or (key_states.shape[1], key_states.shape[3]) != (
        num_kv_heads,
        head_dim,
    ):
        raise UnsupportedModelError(
            f"{model_type}: layer {layer_idx} produced keys of shape "
            f"{tuple(key_states.shape)}, but the cache's layout holds {num_kv_heads} KV heads "
            f"of size {head_dim} ([batch, heads, tokens, head size]); the config does not "
            "describe the attention modules"
        )
