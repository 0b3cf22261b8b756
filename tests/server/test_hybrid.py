"""A hybrid model (random-weight Gemma 3: sliding-window layers alternating with full ones)
served by the engine and over HTTP, with greedy tokens equal to transformers'."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from kvtier.engine import Engine, SamplingParams
from kvtier.models import random_model
from kvtier.server import create_app
from kvtier.server.config import ServerConfig
from tests.engine.tiny import engine_config, reference_tokens, save_folder
from tests.server.live import ServerThread

NAME = "tiny-gemma3"
WINDOW = 24
PROMPTS = [list(range(300 + 11 * i, 300 + 11 * i + 5 * WINDOW + 17 * i)) for i in range(4)]
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def hybrid(tokenizer: Any) -> Any:
    return random_model(
        "gemma3_text",
        seed=2,
        vocab_size=len(tokenizer),
        sliding_window=WINDOW,
        num_hidden_layers=4,
        sliding_window_pattern=2,  # layers 0 and 2 slide, 1 and 3 see everything
    )


@pytest.fixture(scope="module")
def engine(hybrid: Any, tokenizer: Any) -> Iterator[Engine]:
    with Engine(hybrid, tokenizer, engine_config(max_batch_size=4)) as engine:
        yield engine


def test_the_engine_batches_a_hybrid_model_exactly(hybrid: Any, engine: Engine) -> None:
    assert engine.caches[0].windows == [WINDOW, None, WINDOW, None]
    handles = [engine.submit(p, GREEDY) for p in PROMPTS]  # packed together
    outs = [h.result() for h in handles]
    for out, prompt in zip(outs, PROMPTS, strict=True):
        assert out.token_ids == reference_tokens(hybrid, prompt, GREEDY.max_tokens)
    turn2 = PROMPTS[1] + outs[1].token_ids + [7, 8, 9]
    again = engine.submit(turn2, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    done = again.result()
    assert done.reused_tokens > 0
    assert done.token_ids == reference_tokens(hybrid, turn2, 10)


def test_the_server_answers_with_the_engines_tokens(engine: Engine) -> None:
    server = ServerThread(create_app(engine, NAME, ServerConfig()))
    try:
        client = server.client(max_retries=0)

        def ask(prompt: list[int]) -> tuple[str, str]:
            reply = client.completions.create(
                model=NAME,
                prompt=prompt,
                max_tokens=20,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            stream = client.completions.create(
                model=NAME,
                prompt=prompt,
                max_tokens=20,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            return reply.choices[0].text, "".join(c.choices[0].text for c in stream)

        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(ask, PROMPTS))
        for (text, streamed), prompt in zip(answers, PROMPTS, strict=True):
            expected = engine.submit(prompt, GREEDY).result().text
            assert text == expected and streamed == expected
    finally:
        server.stop()


@pytest.mark.slow
def test_kvtier_serve_serves_a_hybrid_model_folder(
    hybrid: Any, tokenizer: Any, tmp_path: Any
) -> None:
    from openai import OpenAI

    from tests.server.test_serve_command import free_port, start, stop

    folder = tmp_path / "gemma3"
    save_folder(folder, tokenizer, hybrid)
    port = free_port()
    process = start(folder, tmp_path / "kv", port, "--served-model-name", NAME)
    try:
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        texts = [
            client.completions.create(
                model=NAME,
                prompt=p,
                max_tokens=20,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            .choices[0]
            .text
            for p in PROMPTS[:2]
        ]
    finally:
        stop(process)
    with Engine.from_pretrained(str(folder), engine_config(max_batch_size=2)) as loaded:
        outs = [loaded.submit(p, GREEDY).result() for p in PROMPTS[:2]]
    for out, prompt, text in zip(outs, PROMPTS[:2], texts, strict=True):
        assert out.token_ids == reference_tokens(hybrid, prompt, GREEDY.max_tokens)
        assert text == out.text
