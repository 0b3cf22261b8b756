"""``kvtier bench kernel_choice`` times every projection of the model each way it can run."""

from __future__ import annotations

import argparse

import pytest
import torch

from kvbench.kernel_choice import projections, run
from kvtier.engine.llama import LlamaModel
from kvtier.models import load_model

pytestmark = pytest.mark.slow  # the slow phase of make test


def test_the_packed_projections_are_the_models_and_every_case_is_timed() -> None:
    model = load_model().model
    llama = LlamaModel(model)
    weights = projections(model, llama)
    assert len(weights) == 4 * len(model.model.layers) + 1
    x = torch.randn(3, weights[0][0].shape[1])
    torch.testing.assert_close(weights[0][1](x), x @ weights[0][0].t(), rtol=1e-4, atol=1e-4)
    args = argparse.Namespace(threads=1, repeats=1, rows=[1, 2], pointwise_rows=[])
    result = run(args)
    assert set(result["matmul_ms"]) == {"1", "2"}
    assert all(ms > 0 for cases in result["matmul_ms"].values() for ms in cases.values())
    assert result["bound_one_row_ms"] > 0 and result["weight_bytes"] > 400e6
