"""Hybrid models (sliding-window layers alternating with full ones) served by the engine and
over HTTP, with greedy tokens equal to transformers' eager attention with its own cache.

Two random-weight models: Gemma 3, and Gemma 2 with its attention scores soft-capped at 5
(query and key projections scaled up so the scores reach the cap; its logits capped at the
published 30). The reference tokens come from a second copy of the weights that kvtier's
attention is never attached to."""

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

NAME = "tiny-hybrid"
WINDOW = 24
PROMPTS = [list(range(300 + 11 * i, 300 + 11 * i + 5 * WINDOW + 17 * i)) for i in range(4)]
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    # layers 0 and 2 slide, 1 and 3 see everything
    "gemma3": ("gemma3_text", {"sliding_window_pattern": 2}),
    "gemma2-soft-capped": ("gemma2", {"attention_gain": 30, "attn_logit_softcapping": 5.0}),
}


def _build(name: str, tokenizer: Any) -> Any:
    arch, fields = MODELS[name]
    return random_model(
        arch,
        seed=2,
        vocab_size=len(tokenizer),
        sliding_window=WINDOW,
        num_hidden_layers=4,
        **fields,
    )


@pytest.fixture(scope="module", params=list(MODELS))
def model_name(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def hybrid(model_name: str, tokenizer: Any) -> Any:
    return _build(model_name, tokenizer)


@pytest.fixture(scope="module")
def reference(model_name: str, tokenizer: Any) -> Any:
    """The same weights, never attached to kvtier: transformers' own attention."""
    return _build(model_name, tokenizer)


def test_the_soft_cap_changes_the_reference_tokens(tokenizer: Any) -> None:
    capped = _build("gemma2-soft-capped", tokenizer)
    uncapped = _build("gemma2-soft-capped", tokenizer)
    for module in uncapped.modules():  # the same weights, the cap off
        if hasattr(module, "attn_logit_softcapping"):
            module.attn_logit_softcapping = None
    prompt = PROMPTS[0]
    assert reference_tokens(capped, prompt, 20) != reference_tokens(uncapped, prompt, 20)


@pytest.fixture(scope="module")
def engine(hybrid: Any, tokenizer: Any) -> Iterator[Engine]:
    with Engine(hybrid, tokenizer, engine_config(max_batch_size=4)) as engine:
        yield engine


def test_the_engine_batches_a_hybrid_model_exactly(reference: Any, engine: Engine) -> None:
    assert engine.caches[0].windows == [WINDOW, None, WINDOW, None]
    assert engine.runner.name == "transformers"  # kvtier's own forward: Llama family only
    handles = [engine.submit(p, GREEDY) for p in PROMPTS]  # packed together
    outs = [h.result() for h in handles]
    for out, prompt in zip(outs, PROMPTS, strict=True):
        assert out.token_ids == reference_tokens(reference, prompt, GREEDY.max_tokens)
    turn2 = PROMPTS[1] + outs[1].token_ids + [7, 8, 9]
    again = engine.submit(turn2, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    done = again.result()
    assert done.reused_tokens > 0
    assert done.token_ids == reference_tokens(reference, turn2, 10)


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
    hybrid: Any, reference: Any, tokenizer: Any, tmp_path: Any
) -> None:
    from openai import OpenAI

    from tests.server.test_serve_command import free_port, start, stop

    folder = tmp_path / hybrid.config.model_type
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
        assert out.token_ids == reference_tokens(reference, prompt, GREEDY.max_tokens)
        assert text == out.text
