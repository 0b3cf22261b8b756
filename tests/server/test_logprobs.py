"""``logprobs`` equal the log-softmax of the same logits from a plain transformers forward,
in both of OpenAI's formats, streamed or not."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from kvtier.engine import Engine, SamplingParams
from kvtier.server import create_app
from kvtier.server.config import ServerConfig
from tests.engine.tiny import engine_config
from tests.server.live import ServerThread

NAME = "tiny-llama"
PROMPT = "The old lighthouse keeper wrote in his journal that the storm"
TOP = 3


@pytest.fixture(scope="module")
def engine(model: Any, tokenizer: Any) -> Iterator[Engine]:
    with Engine(model, tokenizer, engine_config()) as engine:
        yield engine


@pytest.fixture(scope="module")
def server(engine: Engine) -> Iterator[ServerThread]:
    running = ServerThread(create_app(engine, NAME, ServerConfig()))
    yield running
    running.stop()


def reference(model: Any, prompt_ids: list[int], output_ids: list[int]) -> torch.Tensor:
    """``[len(output), V]`` log-softmax of the logits that predicted each output token."""
    ids = torch.tensor([prompt_ids + output_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt_ids) - 1 : -1]
    return torch.log_softmax(logits.float(), dim=-1)


def test_engine_logprobs_equal_a_plain_forward(model: Any, engine: Engine) -> None:
    prompt = engine.encode(PROMPT)
    out = engine.submit(prompt, SamplingParams(temperature=0, max_tokens=12, logprobs=TOP))
    done = out.result()
    assert done.logprobs is not None and len(done.logprobs) == len(done.token_ids)
    expected = reference(model, prompt, done.token_ids)
    for row, token, lp in zip(expected, done.token_ids, done.logprobs, strict=True):
        assert lp.logprob == pytest.approx(float(row[token]), abs=1e-4)
        best = torch.topk(row, TOP)
        assert [t for t, _ in lp.top] == best.indices.tolist()
        assert [v for _, v in lp.top] == pytest.approx(best.values.tolist(), abs=1e-4)
        assert lp.top[0][0] == token  # greedy picks the most likely
    sampled = engine.submit(
        prompt, SamplingParams(temperature=1, seed=3, max_tokens=8, logprobs=0)
    ).result()
    rows = reference(model, prompt, sampled.token_ids)
    assert sampled.logprobs is not None
    for row, token, lp in zip(rows, sampled.token_ids, sampled.logprobs, strict=True):
        assert lp.logprob == pytest.approx(float(row[token]), abs=1e-4) and lp.top == ()
    plain = engine.submit(prompt, SamplingParams(temperature=0, max_tokens=2)).result()
    assert plain.logprobs is None


def test_completions_logprobs_streamed_or_not(
    model: Any, engine: Engine, server: ServerThread
) -> None:
    client = server.client(max_retries=0)
    reply = client.completions.create(
        model=NAME, prompt=PROMPT, max_tokens=10, temperature=0, logprobs=TOP
    )
    choice = reply.choices[0]
    assert choice.logprobs is not None
    tokens = choice.logprobs.tokens or []
    values = choice.logprobs.token_logprobs or []
    prompt = engine.encode(PROMPT)
    done = engine.submit(prompt, SamplingParams(temperature=0, max_tokens=10)).result()
    expected = reference(model, prompt, done.token_ids)
    assert tokens == [engine.token_text(t) for t in done.token_ids]
    assert values == pytest.approx(
        [float(r[t]) for r, t in zip(expected, done.token_ids, strict=True)], abs=1e-4
    )
    tops = choice.logprobs.top_logprobs or []
    assert all(len(top) >= 1 and tokens[i] in top for i, top in enumerate(tops))
    offsets = choice.logprobs.text_offset or []
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    streamed = client.completions.create(
        model=NAME, prompt=PROMPT, max_tokens=10, temperature=0, logprobs=TOP, stream=True
    )
    pieces = [c.choices[0].logprobs for c in streamed if c.choices[0].logprobs is not None]
    assert [t for p in pieces for t in p.tokens or []] == tokens
    assert [v for p in pieces for v in p.token_logprobs or []] == pytest.approx(values)
    assert [o for p in pieces for o in p.text_offset or []] == offsets


def test_chat_logprobs_streamed_or_not(model: Any, engine: Engine, server: ServerThread) -> None:
    client = server.client(max_retries=0)
    messages = [{"role": "user", "content": "Tell me about the sea."}]
    reply = client.chat.completions.create(
        model=NAME,
        messages=messages,
        max_tokens=8,
        temperature=0,
        logprobs=True,
        top_logprobs=TOP,
    )
    logprobs = reply.choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None
    prompt = engine.encode_chat(messages)
    done = engine.submit(prompt, SamplingParams(temperature=0, max_tokens=8)).result()
    expected = reference(model, prompt, done.token_ids)
    assert len(logprobs.content) == len(done.token_ids)
    for entry, row, token in zip(logprobs.content, expected, done.token_ids, strict=True):
        assert entry.token == engine.token_text(token)
        assert entry.bytes == list(entry.token.encode())
        assert entry.logprob == pytest.approx(float(row[token]), abs=1e-4)
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(
            torch.topk(row, TOP).values.tolist(), abs=1e-4
        )
    streamed = client.chat.completions.create(
        model=NAME,
        messages=messages,
        max_tokens=8,
        temperature=0,
        logprobs=True,
        top_logprobs=TOP,
        stream=True,
    )
    entries = [
        e
        for c in streamed
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content or []
    ]
    assert [e.token for e in entries] == [e.token for e in logprobs.content]
    without = client.chat.completions.create(
        model=NAME,
        messages=messages,
        max_tokens=2,
        temperature=0,
    )
    assert without.choices[0].logprobs is None
