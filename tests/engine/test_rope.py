"""RoPE's table (kvtier.engine.rope): the same bits as the model's rotary module."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvtier.engine.rope import RopeTable
from kvtier.random_weights import random_model

SCALINGS: list[tuple[str, dict[str, Any]]] = [
    ("llama", {}),
    ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    (
        "llama",
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 256,
            }
        },
    ),
    ("llama", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}),
    ("qwen2", {}),
    ("phi3", {}),
    ("gemma", {}),
]


@pytest.mark.parametrize(("arch", "overrides"), SCALINGS)
def test_rows_are_the_rotary_modules_bits(arch: str, overrides: dict[str, Any]) -> None:
    """A prefill's positions, a decode batch's scattered ones, and one past the table's
    first size (it grows): each row equals the module's own output for that position."""
    rotary = random_model(arch, **overrides).model.rotary_emb
    table = RopeTable(rotary)
    assert table.tabled
    h = torch.zeros(2, 64)
    for positions in (torch.arange(300), torch.tensor([5, 17, 0, 4097]), torch.tensor([9000])):
        cos, sin = table.rows(h, positions)
        want_cos, want_sin = rotary(h[None], positions[None])
        assert torch.equal(cos, want_cos[0]) and torch.equal(sin, want_sin[0])
    assert table.cos is not None and table.cos.shape[0] == 16384  # powers of two


def test_dynamic_rope_is_not_tabled() -> None:
    """Dynamic NTK scaling changes the frequencies with the longest position of a call, so
    a row depends on its batch: each step calls the module."""
    rotary = random_model(
        "llama", rope_scaling={"rope_type": "dynamic", "factor": 2.0}
    ).model.rotary_emb
    table = RopeTable(rotary)
    assert not table.tabled
    h, positions = torch.zeros(2, 64), torch.tensor([3, 4000])
    cos, sin = table.rows(h, positions)
    assert table.cos is None
    want_cos, want_sin = rotary(h[None], positions[None])
    assert torch.equal(cos, want_cos[0]) and torch.equal(sin, want_sin[0])
