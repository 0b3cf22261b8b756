"""``kvtier bench profile_step`` profiles the step it is asked for and times every step."""

from __future__ import annotations

import argparse

import pytest

from kvbench.profile_step import run

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(
    ("kind", "bf16"), [("decode", False), ("prefill", False), ("decode", True)]
)
def test_the_profiled_step_is_of_the_kind_asked_for(kind: str, bf16: bool) -> None:
    args = argparse.Namespace(
        kind=kind,
        prompts=2,
        prompt_tokens=40,
        new_tokens=3,
        skip=0,
        threads=1,
        top=5,
        seed=0,
        bf16=bf16,
    )
    result = run(args)
    profiled = result["profiled"]
    if kind == "decode":
        assert profiled["tokens"] == profiled["sequences"] == 2
    else:
        assert profiled["tokens"] > profiled["sequences"]
    assert 0 < len(profiled["ops"]) <= 5 and profiled["wall_ms"] > 0
    assert sum(s["tokens"] for s in result["steps"]) == 2 * 40 + 2 * 2  # prompts + decodes
