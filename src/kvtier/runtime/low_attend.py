"""A long prefill pass's attention with its operands rounded to bf16, on torch's CPU flash
kernel: kvtier's bf16 mode (``EngineConfig.matmul_dtype``) for attention.

The pass's queries attend its own keys causally in one call and each run of earlier keys
(resident chunks, the tail before the pass) in a call without a mask, the query heads that
share a KV head folded into the query length; the parts are merged exactly by their
log-sum-exps (``kvtier.attention.merge``). Scores, softmax and sums accumulate in float32
inside torch's kernel; the result is written in float32. In the engine's bf16 mode the KV
cache is bf16 already; float32 keys are rounded as they are read.

Measured against kvtier's float32 ``attend_prefill`` (SmolLM2's shape: 9 query heads over
3, D 64; Intel Xeon with AMX, 2 threads, best of 7; S new tokens over E earlier keys):
S 2,048 over 0: 10.1 against 15.5 ms; 2,048 over 2,048: 21.6 against 48.0; 1,024 over
1,024: 6.4 against 11.4; 256 over 2,048: 2.4 against 4.3; 128 over 4,096: 2.3 against 3.9.
It loses where a pass has few query-key pairs: 512 over 0 1.08 against 1.03, 256 over 0
0.34 against 0.28, 16 over 4,096 0.78 against 0.63. Hence ``LOW_MIN_PAIRS``.

Stateless; reads its inputs, writes ``out`` only. Thread-safe as torch's ops are.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from kvtier.attention import SegmentResult, merge

LOW_MIN_PAIRS = 1 << 18
"""A pass takes the bf16 kernel when its causal query-key pairs per head,
``S * (E + S / 2)``, reach this (512 over 512 earlier keys: 393K; 1,024 over none: 524K;
16 over 4,096: 66K stays on the float32 kernel)."""


def _flash_kernel() -> Callable[..., tuple[torch.Tensor, torch.Tensor]] | None:
    """torch's CPU flash attention with its log-sum-exp (an ``aten`` op of torch 2.x not in
    its public API); None where this torch lacks it (the float32 kernel then runs)."""
    ops: Any = torch.ops.aten
    try:
        return ops._scaled_dot_product_flash_attention_for_cpu
    except (AttributeError, RuntimeError):
        return None


_FLASH = _flash_kernel()


def causal_pairs(new_tokens: int, earlier_tokens: int) -> float:
    """The query-key pairs per head a causal pass of ``new_tokens`` over ``earlier_tokens``
    earlier keys scores: ``S * (E + S / 2)``."""
    return new_tokens * (earlier_tokens + new_tokens / 2)


def takes(new_tokens: int, earlier_tokens: int) -> bool:
    """Whether a pass of ``new_tokens`` over ``earlier_tokens`` earlier keys is worth the
    bf16 kernel (``LOW_MIN_PAIRS``) and this torch has it."""
    return _FLASH is not None and causal_pairs(new_tokens, earlier_tokens) >= LOW_MIN_PAIRS


def attend_prefill_low(
    query: torch.Tensor,
    k_old: torch.Tensor,
    v_old: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    out: torch.Tensor,
    scale: float,
    dtype: torch.dtype = torch.bfloat16,
) -> None:
    """``query [Hq, S, D]`` (any strides) over ``k_old``/``v_old [Hkv, E, D]`` (E may be 0)
    and ``k_new``/``v_new [Hkv, P + S, D]`` (``attend_prefill``'s contract: the first P
    visible to every query, then the pass's own, causally), with the operands rounded to
    ``dtype``; writes ``out [S, Hq, D]`` (float32). Call only where ``takes`` holds (with
    E + P earlier keys).

    Raises:
        ValueError: the query heads are not a multiple of the KV heads, or the shapes
            disagree.
    """
    flash = _FLASH
    assert flash is not None, "attend_prefill_low: call only where takes() holds"
    hq, sq, dim = query.shape
    hkv, pre = k_new.shape[0], k_new.shape[1] - sq
    if (
        hq % hkv != 0
        or pre < 0
        or k_new.shape[2] != dim
        or k_old.shape[0] != hkv
        or tuple(out.shape) != (sq, hq, dim)
    ):
        raise ValueError(
            f"attend_prefill_low: query {tuple(query.shape)}, new keys {tuple(k_new.shape)}, "
            f"out {tuple(out.shape)}: need [Hq, S, D], [Hkv, P + S, D], [S, Hq, D], Hkv | Hq"
        )
    groups = hq // hkv
    q = query.to(dtype, memory_format=torch.contiguous_format)  # [Hq, S, D], owned here
    # own keys: batch = KV heads, heads = the group sharing each (K/V expanded, not copied)
    shape = (hkv, groups, sq, dim)
    own, own_lse = flash(
        q.view(shape),
        k_new[:, pre:].to(dtype)[:, None].expand(shape),
        v_new[:, pre:].to(dtype)[:, None].expand(shape),
        0.0,
        True,
        scale=scale,
    )  # [Hkv, G, S, D], [Hkv, G, S]
    parts = [SegmentResult(own.reshape(1, hq, sq, dim).float(), own_lse.reshape(1, hq, sq))]
    # earlier keys: every query sees all of them; the group folds into the query length
    for keys, values in ((k_old, v_old), (k_new[:, :pre], v_new[:, :pre])):
        if keys.shape[1] == 0:
            continue
        old, old_lse = flash(
            q.view(1, hkv, groups * sq, dim),
            keys.to(dtype)[None],
            values.to(dtype)[None],
            0.0,
            False,
            scale=scale,
        )  # [1, Hkv, G*S, D], [1, Hkv, G*S]
        parts.append(SegmentResult(old.reshape(1, hq, sq, dim).float(), old_lse.reshape(1, hq, sq)))
    out.copy_(merge(parts).out[0].transpose(0, 1))  # exact, by the log-sum-exps
