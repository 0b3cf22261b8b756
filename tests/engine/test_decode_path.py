"""The path of decode-only steps (``kvtier.engine.decode_path``): measured on the steps
themselves between the projections' own limit and what ``decode_layers`` takes, and exact
whichever path a step takes."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from kvtier import native
from kvtier.engine import Engine, SamplingParams
from kvtier.engine.decode_path import DecodePath
from kvtier.engine.linear import MEASURED_ROWS
from kvtier.engine.runner import LlamaRunner
from kvtier.models import random_model
from tests.engine.tiny import engine_config, record_one_call_steps, reference_tokens


def test_row_counts_between_the_limits_alternate_then_keep_the_faster_path() -> None:
    path = DecodePath(fused_max_rows=8, trial_max_rows=64, trials=2)
    assert path.fused(1) and path.fused(8)  # the projections alone chose the one call
    assert not path.fused(65)  # more than decode_layers takes
    timings = {True: 0.030, False: 0.045}
    taken = []
    for _ in range(4):
        one_call = path.fused(12)
        taken.append(one_call)
        path.record(12, one_call, timings[one_call])
    assert taken == [True, False, True, False]
    assert path.decided == {16: True}
    assert path.fused(9) and path.fused(16)  # the whole size class 9-16
    path.record(16, False, 0.001)  # decided: later steps change nothing
    assert path.fused(16)
    for _ in range(4):  # 17-32 rows: the loop measured faster
        one_call = path.fused(20)
        path.record(20, one_call, 0.050 if one_call else 0.040)
    assert path.decided == {16: True, 32: False}
    assert not path.fused(32)
    path.record(4, True, 1.0)  # outside the measured range: ignored
    assert 4 not in path.decided
    with pytest.raises(ValueError, match="trials must be at least 1"):
        DecodePath(8, 64, trials=0)


def test_an_engine_tries_both_paths_and_its_tokens_stay_exact(
    tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The projections' limit set to 1 row: decode steps of 2-5 rows are tried on both paths
    (the loop's projections on oneDNN), the class is decided, and every token equals
    transformers'."""
    if native.ops() is None:
        pytest.skip("kvtier's CPU kernels are not built here")
    model = random_model("llama", seed=3, vocab_size=len(tokenizer))
    MEASURED_ROWS[model] = {torch.get_num_threads(): 1}
    paths = record_one_call_steps(monkeypatch)
    prompts = [list(range(200 + 11 * i, 200 + 11 * i + n)) for i, n in enumerate((5, 23, 40))]
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    config = dataclasses.replace(engine_config(), runner="kvtier")
    with Engine(model, tokenizer, config) as engine:
        assert isinstance(engine.runner, LlamaRunner)
        llama = engine.runner.llama
        assert llama.rows_kernel_max == 1
        outs = [h.result() for h in [engine.submit(p, greedy) for p in prompts]]
        decided = dict(llama.decode_path.decided)
    assert [o.token_ids for o in outs] == [reference_tokens(model, p, 16) for p in prompts]
    assert 4 in decided  # the 3-row decode steps' class was measured and decided
    assert paths  # the one call took some of them
