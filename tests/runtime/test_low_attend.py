"""A long prefill pass's attention in bf16 (``kvtier.runtime.low_attend``): the attention of
the bf16-rounded operands, merged exactly over the earlier and the own keys, written in
float32 into the rows it is given and nowhere else; taken only for passes with enough
query-key pairs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvtier.runtime import low_attend

pytestmark = pytest.mark.skipif(
    not low_attend.takes(4096, 4096), reason="this torch has no CPU flash kernel with LSE"
)


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, earlier: int) -> torch.Tensor:
    """float64 attention of ``q [Hq, S, D]`` over ``k``/``v [Hkv, E+S, D]``: the first
    ``earlier`` keys all visible, the rest causal; ``[S, Hq, D]``."""
    new = q.shape[1]
    mask = torch.ones(new, earlier + new, dtype=torch.bool)
    mask[:, earlier:] = torch.ones(new, new, dtype=torch.bool).tril()
    out = F.scaled_dot_product_attention(
        q[None].double(),
        k[None].double(),
        v[None].double(),
        attn_mask=mask,
        scale=q.shape[-1] ** -0.5,
        enable_gqa=True,
    )
    return out[0].transpose(0, 1).float()


@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "earlier", "new"),
    [
        (9, 3, 64, 0, 800),  # a cold pass: own keys only
        (9, 3, 64, 700, 400),  # a later chunk over the tail before it
        (8, 2, 128, 1500, 200),  # head dim 128, 4 query heads a KV head
        (4, 4, 64, 333, 777),  # no grouping, odd counts
    ],
)
def test_attention_of_the_rounded_operands_written_in_its_rows_only(
    heads: int, kv_heads: int, dim: int, earlier: int, new: int
) -> None:
    torch.manual_seed(0)
    width = (heads + 2 * kv_heads) * dim  # the query a strided view, as the engine passes it
    q = torch.randn(new, width)[:, : heads * dim].view(new, heads, dim).transpose(0, 1)
    k_old, v_old = torch.randn(2, kv_heads, earlier + 3, dim)[:, :, :earlier]
    k_new, v_new = torch.randn(2, kv_heads, new, dim)
    assert low_attend.takes(new, earlier)
    out = torch.full((new + 1, heads + 1, dim), 7.0)
    low_attend.attend_prefill_low(
        q, k_old, v_old, k_new, v_new, out[:new, :heads], dim**-0.5, torch.bfloat16
    )
    k, v = torch.cat([k_old, k_new], 1), torch.cat([v_old, v_new], 1)
    rounded = _reference(q.bfloat16().float(), k.bfloat16().float(), v.bfloat16().float(), earlier)
    # the kernel rounds the probabilities to bf16 before the value product: 2^-8 relative
    torch.testing.assert_close(out[:new, :heads], rounded, atol=8e-3, rtol=2**-7)
    exact = _reference(q, k, v, earlier)
    assert not torch.equal(out[:new, :heads], exact)  # another computation than float32's
    assert (out[new:] == 7.0).all() and (out[:, heads:] == 7.0).all()


def test_short_passes_stay_on_the_float32_kernel() -> None:
    """The threshold is the causal query-key pairs per head, ``LOW_MIN_PAIRS``."""
    assert not low_attend.takes(512, 0)  # 131K pairs: a tie measured
    assert low_attend.takes(1024, 0)  # 524K
    assert low_attend.takes(256, 2048)  # 557K
    assert not low_attend.takes(16, 4096)  # 66K: a few queries over a long history


def test_shapes_that_disagree_are_refused_in_one_line() -> None:
    q = torch.randn(6, 600, 64)
    k = torch.randn(4, 600, 64)  # 6 query heads over 4 KV heads
    out = torch.empty(600, 6, 64)
    with pytest.raises(ValueError, match=r"attend_prefill_low: query \(6, 600, 64\)"):
        low_attend.attend_prefill_low(q, k[:, :0], k[:, :0], k, k, out, 0.125)


def test_keys_leading_k_new_are_visible_to_every_query() -> None:
    """``attend_prefill``'s contract: k_new may lead with P keys before the pass (a tail
    over resident chunks); they join the earlier keys' merge."""
    torch.manual_seed(1)
    q = torch.randn(9, 600, 64)
    k_old, v_old = torch.randn(2, 3, 512, 64)
    k_new, v_new = torch.randn(2, 3, 100 + 600, 64)
    assert low_attend.takes(600, 512 + 100)
    out = torch.empty(600, 9, 64)
    low_attend.attend_prefill_low(q, k_old, v_old, k_new, v_new, out, 0.125, torch.bfloat16)
    k, v = torch.cat([k_old, k_new], 1), torch.cat([v_old, v_new], 1)
    rounded = _reference(q.bfloat16().float(), k.bfloat16().float(), v.bfloat16().float(), 612)
    torch.testing.assert_close(out, rounded, atol=8e-3, rtol=2**-7)
