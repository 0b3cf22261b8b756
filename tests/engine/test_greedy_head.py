"""The greedy head's int8 screen: the same first maximum as the float32 head, its candidates'
logits bit for bit the head's, and the runner asks for it only where nothing else of the
logits is read."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from kvtier import native
from kvtier.engine import Engine, SamplingParams
from kvtier.engine.greedy_head import ROWS_MAX, GreedyHead
from kvtier.engine.linear import MEASURED_ROWS, make_linear
from kvtier.engine.llama import LlamaModel
from kvtier.engine.runner import LlamaRunner
from tests.engine.tiny import engine_config, reference_tokens, tiny_model

ops = native.ops()
pytestmark = pytest.mark.skipif(ops is None, reason="kvtier's CPU kernels are not built")


def head_and_screen(vocab: int, hidden: int, seed: int) -> tuple[Any, GreedyHead]:
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(vocab, hidden, generator=gen) * 0.05
    weight[7] = weight[3]  # an exact tie: the first index must win
    weight[11] = torch.nextafter(weight[5], torch.full_like(weight[5], 1.0))  # one ulp apart
    weight[13] = 0.0  # a zero row: scale 0
    return make_linear(weight, None, ops), GreedyHead.build(weight, ops)


def check_rows(head: Any, screen: GreedyHead, x: torch.Tensor) -> list[int]:
    """Asserts the screen's argmax and finite logits are the full head's; the candidates'
    counts per row."""
    full = head(x)
    out = screen.logits(x)
    assert out.shape == full.shape and out.dtype == torch.float32
    counts = []
    for r in range(x.shape[0]):
        kept = torch.isfinite(out[r])
        assert int(out[r].numpy().argmax()) == int(full[r].numpy().argmax())
        assert torch.equal(out[r][kept], full[r][kept])  # the head's bits
        counts.append(int(kept.sum()))
    return counts


@pytest.mark.parametrize("hidden", [64, 576])
def test_the_screen_keeps_the_heads_first_maximum_and_its_bits(hidden: int) -> None:
    head, screen = head_and_screen(3000, hidden, seed=hidden)
    assert screen.screen.dtype == torch.int8
    gen = torch.Generator().manual_seed(1)
    counts: list[int] = []
    for rows in (1, 2, 7, 8, 9, 16, 33):
        for scale in (1e-3, 1.0, 30.0, 1e4):
            counts += check_rows(head, screen, torch.randn(rows, hidden, generator=gen) * scale)
    # rows aimed at the tie and the one-ulp pair: both tokens stay and the first wins
    w = screen.weight
    check_rows(head, screen, torch.stack([w[3] * 50, w[5] * 50, w[11] * 50]))
    assert max(counts) < 3000  # it screens: not every token is computed (of the union)


def test_rows_without_a_bound_are_computed_whole() -> None:
    """A NaN or inf in the row: no bound holds, so every token is the head's own."""
    head, screen = head_and_screen(500, 64, seed=2)
    x = torch.randn(3, 64)
    x[1, 5] = float("nan")
    x[2, 9] = float("inf")
    out, full = screen.logits(x), head(x)
    for r in (1, 2):
        assert torch.equal(out[r].isnan(), full[r].isnan())
        kept = ~full[r].isnan()
        assert torch.equal(out[r][kept], full[r][kept])
    assert int(out[0].argmax()) == int(full[0].argmax())


def test_the_screen_is_refused_a_head_it_cannot_bound() -> None:
    with pytest.raises(ValueError, match="float32 CPU"):
        GreedyHead.build(torch.zeros(4, 8, dtype=torch.bfloat16), ops)
    weight = torch.zeros(4, 8)
    weight[2, 3] = float("inf")
    assert GreedyHead.why_not(weight) is not None
    with pytest.raises(ValueError, match="NaN or an infinity"):
        GreedyHead.build(weight, ops)


def test_the_runner_screens_only_greedy_steps_without_logprobs(
    tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Greedy tokens equal transformers' with the screen; a step holding a request that
    reads log-probabilities (or samples) gets the whole head."""
    model = tiny_model(tokenizer, seed=4)
    prompt = list(range(300, 340))
    calls: list[bool] = []
    original = GreedyHead.logits

    def logits(self: GreedyHead, x: torch.Tensor) -> torch.Tensor:
        calls.append(True)
        return original(self, x)

    monkeypatch.setattr(GreedyHead, "logits", logits)
    config = dataclasses.replace(engine_config(), runner="kvtier")
    with Engine(model, tokenizer, config) as engine:
        assert isinstance(engine.runner, LlamaRunner)
        assert engine.runner.llama.greedy_head is not None
        greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
        tokens = engine.submit(prompt, greedy).result().token_ids
        assert tokens == reference_tokens(model, prompt, 10)
        assert calls  # the screen ran
        calls.clear()
        with_logprobs = dataclasses.replace(greedy, logprobs=2)
        out = engine.submit(prompt, with_logprobs).result()
        assert out.token_ids == tokens and not calls
        assert all(lp.logprob > -float("inf") for lp in out.logprobs or [])
        sampled = SamplingParams(temperature=0.8, seed=1, max_tokens=4, ignore_eos=True)
        engine.submit(prompt, sampled).result()
        assert not calls


def test_the_model_screens_up_to_rows_max_rows(tokenizer: Any) -> None:
    """``argmax_only`` with at most ``ROWS_MAX`` sampled rows: the screen (the same argmax,
    ``-inf`` where it ruled tokens out); more rows: the whole head."""
    model = tiny_model(tokenizer, seed=5)
    MEASURED_ROWS[model] = {torch.get_num_threads(): 64}  # the head on linear_panels
    llama = LlamaModel(model)
    assert llama.greedy_head is not None
    spans = [(0, 9), (9, 7), (16, 12), (28, 5), (33, 8), (41, 6)]
    ids = torch.tensor([(500 + 13 * i) % 4000 for i in range(47)])
    positions = torch.cat([torch.arange(n) for _, n in spans])
    ends = torch.tensor([start + n - 1 for start, n in spans])
    with torch.no_grad():
        for count in (1, ROWS_MAX, ROWS_MAX + 1):
            rows = ends[:count]
            full = llama.forward(ids, positions, None, spans, rows)
            fast = llama.forward(ids, positions, None, spans, rows, argmax_only=True)
            assert torch.equal(fast.argmax(dim=1), full.argmax(dim=1))
            kept = torch.isfinite(fast)
            assert torch.equal(fast[kept], full[kept])
            assert bool(kept.all()) == (count > ROWS_MAX)
