"""kvtier's attention for transformers: registration, the mask hook and the forward hooks.

``attach(model)`` registers ``"kvtier"`` in transformers' ``AttentionInterface`` and
``AttentionMaskInterface``, switches the model to it, and hooks the model's forward so a
kvtier cache learns each forward's token ids (to key chunks by) and padding before it, and
seals after it. The attention function hands a kvtier layer view (``LayerKV`` or
``PackedKV``) to ``kvtier.runtime``'s dispatch, which reads it and mutates nothing.
Called with plain tensors (another cache, or none), it falls back to transformers' SDPA
attention, so an attached model still works with ``DynamicCache``.

Soft-capping: the cap a model's modelling hands its attention function (``softcap=``, which
Gemma 2 sets to ``attn_logit_softcapping``) is applied to every score, before the mask and
softmax, on every path (kvtier's segments, and the fallback, where SDPA has no cap: there
kvtier's ``attend_segment`` runs over the plain tensors with transformers' boolean mask).
The modelling's ``softcap`` argument, not the module's attribute, is what counts: Gemma 3
modules hold ``attn_logit_softcapping`` but do not pass it, and eager attention does not
apply it.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

from kvtier.attention import attend_segment
from kvtier.hf.base import SelfManagedCache
from kvtier.runtime import LayerKV, PackedKV, attend, attend_packed

ATTENTION_NAME = "kvtier"


@dataclass(frozen=True)
class DeferredMask:
    """What the mask hook hands to every layer: the arguments transformers gave it.

    A kvtier cache's layers ignore it (the cache got the padding mask at the start of the
    forward); a layer not backed by one builds transformers' SDPA mask from it.
    """

    mask_kwargs: dict[str, Any]

    def sdpa_mask(self) -> torch.Tensor | None:
        return ALL_MASK_ATTENTION_FUNCTIONS["sdpa"](**self.mask_kwargs)

    def bool_mask(self) -> torch.Tensor | None:
        """The mask as booleans ``[B, 1, Sq, Sk]`` (True: attend), built even where SDPA
        would rely on its causal flag instead (None where transformers builds none)."""
        return ALL_MASK_ATTENTION_FUNCTIONS["sdpa"](
            **{**self.mask_kwargs, "allow_is_causal_skip": False}
        )


def mask_hook(**kwargs: Any) -> DeferredMask:
    """Mask function registered for ``"kvtier"``: defer the mask to the layers."""
    return DeferredMask(kwargs)


def tiered_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: Any,
    value: Any,
    attention_mask: Any,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: ``query [B, Hq, Sq, D]`` → ``[B, Sq, Hq, D]``.

    ``kwargs["softcap"]`` (Gemma 2's ``attn_logit_softcapping``) caps every score; the other
    keyword arguments go to the SDPA fallback only.
    """
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    cap = kwargs.pop("softcap", None)
    softcap = float(cap) if cap is not None else None
    if isinstance(key, PackedKV):
        return attend_packed(key, query, scale, softcap=softcap), None
    if not isinstance(key, LayerKV) and softcap is not None:
        return _capped_fallback(query, key, value, attention_mask, scale, softcap), None
    if not isinstance(key, LayerKV):
        mask = (
            attention_mask.sdpa_mask()
            if isinstance(attention_mask, DeferredMask)
            else attention_mask
        )
        return sdpa_attention_forward(
            module, query, key, value, mask, dropout=dropout, scaling=scale, **kwargs
        )
    return attend(key, query, scale, softcap).transpose(1, 2).contiguous(), None


def _capped_fallback(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    scale: float,
    softcap: float,
) -> torch.Tensor:
    """Soft-capped attention over plain tensors ``key, value [B, Hkv, Sk, D]`` (SDPA has no
    cap): ``attend_segment`` with transformers' mask as booleans → ``[B, Sq, Hq, D]``."""
    mask = attention_mask.bool_mask() if isinstance(attention_mask, DeferredMask) else None
    if isinstance(attention_mask, torch.Tensor):
        mask = attention_mask
    if mask is None and query.shape[2] > 1:  # SDPA's rule: causal, the queries last
        result = attend_segment(
            query,
            key,
            value,
            scale,
            query_positions=key.shape[2] - query.shape[2],
            softcap=softcap,
        )
    else:
        result = attend_segment(query, key, value, scale, mask=mask, softcap=softcap)
    return result.out.to(query.dtype).transpose(1, 2).contiguous()


def _forward_arguments(
    module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> dict[str, Any]:
    """The model's forward arguments by name (positional ones bound to their names)."""
    if not args:
        return kwargs
    signature = getattr(module, "_kvtier_signature", None)
    if signature is None:
        signature = inspect.signature(module.forward)
        setattr(module, "_kvtier_signature", signature)  # noqa: B010 (a Module attribute)
    return signature.bind_partial(*args, **kwargs).arguments


def _kvtier_cache(arguments: dict[str, Any]) -> SelfManagedCache | None:
    cache = arguments.get("cache", arguments.get("past_key_values"))
    return cache if isinstance(cache, SelfManagedCache) else None


def _begin_hook(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Before a forward on a kvtier cache: hand it the new tokens' ids and padding."""
    arguments = _forward_arguments(module, args, kwargs)
    cache = _kvtier_cache(arguments)
    if cache is None:
        return
    ids = arguments.get("input_ids")
    embeds = arguments.get("inputs_embeds")
    new = ids if isinstance(ids, torch.Tensor) else embeds
    if not isinstance(new, torch.Tensor):
        return  # the model will refuse the call itself
    mask = arguments.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() != 2:
        raise ValueError(
            f"attention_mask: kvtier caches take the 2D padding mask [batch, tokens], got "
            f"shape {tuple(mask.shape)}"
        )
    padding = mask if isinstance(mask, torch.Tensor) and not bool(mask.all()) else None
    token_ids = ids.detach() if isinstance(ids, torch.Tensor) else None
    cache.begin_forward(token_ids, new.shape[1], new.shape[0], padding)


def _end_hook(
    module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
) -> None:
    """After a forward on a kvtier cache completed: seal and place its chunks."""
    cache = _kvtier_cache(_forward_arguments(module, args, kwargs))
    if cache is not None:
        cache.end_forward()


def register() -> None:
    """Register ``"kvtier"`` with transformers (idempotent)."""
    AttentionInterface.register(ATTENTION_NAME, tiered_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, mask_hook)


def attach(model: torch.nn.Module) -> None:
    """Switch ``model`` to kvtier attention and hook its forward (idempotent).

    The hooks begin and end each forward of a kvtier cache (``begin_forward`` with the
    input ids and padding mask, ``end_forward`` once the forward returned); forwards on any
    other cache pass untouched.
    """
    register()
    if getattr(model.config, "_attn_implementation", None) != ATTENTION_NAME:
        model.set_attn_implementation(ATTENTION_NAME)  # type: ignore[operator]
    if not getattr(model, "_kvtier_hooked", False):
        model.register_forward_pre_hook(_begin_hook, with_kwargs=True)
        model.register_forward_hook(_end_hook, with_kwargs=True)
        setattr(model, "_kvtier_hooked", True)  # noqa: B010 (a Module attribute)
