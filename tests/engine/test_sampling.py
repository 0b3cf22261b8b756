"""Sampling parameters, the sampling functions, and the stop-string-aware text stream."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

from kvtier.engine import ParamError, SamplingParams
from kvtier.engine.sampling import TextStream, filter_logits, make_generator, sample
from tests.engine.tiny import embedded_tokenizer


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.1),
        ("temperature", "hot"),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -1),
        ("top_k", 2.5),
        ("max_tokens", 0),
        ("max_tokens", True),
        ("stop", ("",)),
        ("stop", (3,)),
        ("seed", 1.5),
    ],
)
def test_params_reject_out_of_range_naming_the_field(field: str, value: Any) -> None:
    with pytest.raises(ParamError, match=f"^{field}: ") as info:
        SamplingParams(**{field: value})
    assert info.value.param == field
    assert isinstance(info.value, ValueError)


def test_params_normalise_stop_and_know_greedy() -> None:
    assert SamplingParams(stop="x").stop == ("x",)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")  # type: ignore[arg-type]
    assert SamplingParams(temperature=0).greedy
    assert not SamplingParams().greedy


def test_filter_logits_top_k_and_top_p() -> None:
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    assert torch.equal(filter_logits(logits), logits)
    kept = filter_logits(logits, top_k=2).isfinite()
    assert kept.tolist() == [True, True, False, False]
    # 0.5 + 0.3 reaches 0.8: the third token is dropped; 0.81 needs it.
    assert filter_logits(logits, top_p=0.8).isfinite().tolist() == [True, True, False, False]
    assert filter_logits(logits, top_p=0.81).isfinite().tolist() == [True, True, True, False]
    assert filter_logits(logits, top_p=0.01).isfinite().tolist() == [True, False, False, False]
    batch = filter_logits(torch.stack([logits, logits.flip(0)]), top_k=1).isfinite()
    assert batch.tolist() == [[True, False, False, False], [False, False, False, True]]


def test_sample_greedy_seeded_and_within_the_filtered_set() -> None:
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    greedy = SamplingParams(temperature=0)
    assert sample(logits, greedy) == int(logits.argmax())
    # ties and NaN pick what torch's argmax picks (the first maximum; the first NaN)
    tied = torch.tensor([0.5, 2.0, -1.0, 2.0])
    assert sample(tied, greedy) == int(tied.argmax()) == 1
    poisoned = torch.tensor([0.5, float("nan"), 3.0, float("nan")])
    assert sample(poisoned, greedy) == int(poisoned.argmax()) == 1
    params = SamplingParams(temperature=1.3, top_k=50, top_p=0.9, seed=11)
    draws = [sample(logits, params, make_generator(11)) for _ in range(3)]
    assert len(set(draws)) == 1  # same seed, same draw
    gen = make_generator(11)
    sequence = [sample(logits, params, gen) for _ in range(200)]
    allowed = set(torch.nonzero(filter_logits(logits / 1.3, 50, 0.9).isfinite()).flatten().tolist())
    assert set(sequence) <= allowed
    assert len(set(sequence)) > 5  # it does sample
    gen = make_generator(12)
    assert [sample(logits, params, gen) for _ in range(200)] != sequence
    wide = logits.double()  # float64 logits (any dtype) give the same draws, and stay as given
    kept = wide.clone()
    gen, twin = make_generator(13), make_generator(13)
    assert [sample(wide, params, gen) for _ in range(20)] == [
        sample(logits, params, twin) for _ in range(20)
    ]
    assert torch.equal(wide, kept)
    with warnings.catch_warnings():  # a tiny temperature: the others overflow to -inf, quietly
        warnings.simplefilter("error")
        tiny = SamplingParams(temperature=1e-30)
        assert sample(logits * 50, tiny, make_generator(1)) == int(logits.argmax())


def test_draws_follow_the_distribution_and_never_pick_a_filtered_token() -> None:
    """40,000 seeded draws over five tokens (one filtered out by top-k): each token's share
    is within 1.5 % of its probability, and the filtered one (the last) is never drawn."""
    logits = torch.tensor([0.0, 1.0, 2.0, -1.0, -3.0])
    params = SamplingParams(temperature=1.0, top_k=4, seed=3)
    gen = make_generator(3)
    counts = torch.bincount(
        torch.tensor([sample(logits, params, gen) for _ in range(40_000)]), minlength=5
    )
    expected = torch.softmax(filter_logits(logits, top_k=4).double(), dim=-1)
    assert counts[4] == 0
    assert torch.allclose(counts.double() / counts.sum(), expected, atol=0.015)


def test_a_draw_over_many_blocks_is_the_inverse_of_the_cumulative_weight() -> None:
    """Over a vocabulary of 1,037 tokens (8 blocks and a ragged end), two thirds filtered
    out: each draw is the first token whose cumulative probability (one running sum, as
    the definition reads) exceeds the same uniform number times the total."""
    logits = torch.randn(1037, generator=torch.Generator().manual_seed(5)) * 4
    params = SamplingParams(temperature=0.7, top_k=350, seed=9)
    gen, twin = make_generator(9), make_generator(9)
    weights = torch.softmax(filter_logits(logits.double() / 0.7, top_k=350), dim=-1)
    cumulative = torch.cumsum(weights, dim=-1)
    for _ in range(2_000):
        point = torch.rand(1, generator=twin, dtype=torch.float64) * cumulative[-1]
        expected = int(torch.searchsorted(cumulative, point, right=True))
        assert sample(logits, params, gen) == expected
        assert weights[expected] > 0


def stream_all(stream: TextStream, ids: list[int]) -> list[str]:
    return [stream.push(t) for t in ids]


def test_text_stream_reassembles_the_decoded_text() -> None:
    tokenizer = embedded_tokenizer()
    text = "Hello there, naïve café owner! Ünïcödé 🙂 and 日本語 work too."
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    stream = TextStream(tokenizer)
    deltas = stream_all(stream, ids)
    deltas.append(stream.flush())
    assert "".join(deltas) == tokenizer.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)  # never half a character
    assert len([d for d in deltas if d]) > 5  # it streams, rather than all at the end


def test_text_stream_cuts_at_the_first_stop_string_and_holds_back_partials() -> None:
    tokenizer = embedded_tokenizer()
    text = "The answer is 42. END of story, really END."
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    stream = TextStream(tokenizer, stop=("END", "never"))
    deltas = stream_all(stream, ids)
    assert stream.stopped
    assert "".join(deltas) == "The answer is 42. "
    assert stream.text == "The answer is 42. "
    assert stream.flush() == ""
    # A stop string that spans tokens: nothing after its start is ever shown.
    stream = TextStream(tokenizer, stop=("is 4",))
    shown = "".join(stream_all(stream, ids))
    assert shown == "The answer "
    # A partial stop string at the end is held back until it cannot match, then shown.
    stream = TextStream(tokenizer, stop=("42!",))
    prefix = tokenizer("The answer is 42", add_special_tokens=False)["input_ids"]
    shown = "".join(stream_all(stream, prefix))
    assert not shown.endswith("4") and not stream.stopped
    assert shown + stream.flush() == "The answer is 42"
