"""No request can harm another: each bad value, sent while three streams run, gets its own
answer; the three finish with the tokens they have without it; the server serves on."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from kvbench.redis_cluster import available
from kvtier.engine import Engine
from kvtier.server import create_app
from kvtier.server.config import ServerConfig
from tests.engine.tiny import engine_config, with_remote
from tests.server.live import KEY, ServerThread

NAME = "tiny-llama"
COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
STREAM_PROMPTS = [
    "The lighthouse keeper counted the ships that passed in the night and",
    "A recipe for bread begins with flour, water, salt and",
    "In the first chapter of the book, the detective finds",
]
MESSAGES = [{"role": "user", "content": "Say something about the sea."}]


def completion(**fields: Any) -> dict[str, Any]:
    return {"model": NAME, "prompt": "Hello there", "max_tokens": 4, **fields}


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": NAME, "messages": MESSAGES, "max_tokens": 4, **fields}


# (path, raw JSON body, the statuses it may get, the field a 400 must name)
POISON: list[tuple[str, str, set[int], str | None]] = [
    (COMPLETIONS, json.dumps(completion(temperature=1, seed=2**64)), {400}, "seed"),
    (COMPLETIONS, json.dumps(completion(temperature=1, seed=-(2**63) - 1)), {400}, "seed"),
    (COMPLETIONS, json.dumps(completion(seed=10**40)), {400}, "seed"),
    (COMPLETIONS, json.dumps(completion(temperature=1e-300)), {200}, None),
    (COMPLETIONS, json.dumps(completion(temperature=1, top_p=1e-300)), {200}, None),
    (CHAT, json.dumps(chat(temperature=1, top_p=1.11e-308)), {200}, None),
    (CHAT, json.dumps(chat(temperature=5e-324, top_p=5e-324, seed=0)), {200}, None),
    (COMPLETIONS, json.dumps(completion(top_k=10**30, temperature=1)), {200}, None),
    (
        COMPLETIONS,
        '{"model": "tiny-llama", "prompt": "x", "temperature": Infinity}',
        {400},
        "temperature",
    ),
    (
        COMPLETIONS,
        '{"model": "tiny-llama", "prompt": "x", "temperature": NaN}',
        {400},
        "temperature",
    ),
    (CHAT, '{"model": "tiny-llama", "messages": [], "top_p": -Infinity}', {400}, "top_p"),
    (COMPLETIONS, json.dumps(completion(temperature=2.5)), {400}, "temperature"),
    (COMPLETIONS, json.dumps(completion(top_p=0)), {400}, "top_p"),
    (COMPLETIONS, json.dumps(completion(top_k=-1)), {400}, "top_k"),
    (COMPLETIONS, json.dumps(completion(max_tokens=10**30)), {400}, "max_tokens"),
    (COMPLETIONS, json.dumps(completion(max_tokens=0)), {400}, "max_tokens"),
    (COMPLETIONS, json.dumps(completion(prompt=[-1])), {400}, "prompt"),
    (COMPLETIONS, json.dumps(completion(prompt=[10**30])), {400}, "prompt"),
    (COMPLETIONS, json.dumps(completion(prompt=[1] * 5000)), {400}, "prompt"),
    (COMPLETIONS, json.dumps(completion(prompt=[1.5] * 100_000)), {400}, "prompt"),
    (COMPLETIONS, json.dumps(completion(prompt=["a"] + [1] * 100_000)), {400}, "prompt"),
    (COMPLETIONS, json.dumps(completion(stop=[1] * 100_000)), {400}, "stop"),
    (CHAT, json.dumps(chat(messages=[{"role": "x"}] * 60_000)), {400}, "messages[0].role"),
    (COMPLETIONS, json.dumps(completion(prompt=[])), {400}, "prompt"),
    (COMPLETIONS, '{"model": "tiny-llama", "prompt": "a \\ud800 b"}', {400}, "prompt"),
    (
        CHAT,
        '{"model": "tiny-llama", "messages": [{"role": "user", "content": "\\udfff"}]}',
        {400},
        "messages[0].content",
    ),
    (COMPLETIONS, '{"model": "tiny-llama", "prompt": "x", "stop": ["\\ud800"]}', {400}, "stop[0]"),
    (COMPLETIONS, json.dumps(completion(stop=["s"] * 17)), {400}, "stop"),
    (COMPLETIONS, json.dumps(completion(stop="x" * 257)), {400}, "stop"),
    (COMPLETIONS, json.dumps(completion(n=2)), {400}, "n"),
    (COMPLETIONS, json.dumps(completion(logprobs=21)), {400}, "logprobs"),
    (COMPLETIONS, json.dumps(completion(logprobs=-1)), {400}, "logprobs"),
    (COMPLETIONS, json.dumps(completion(logprobs=5, temperature=1e-300)), {200}, None),
    (CHAT, json.dumps(chat(logprobs=True, top_logprobs=21)), {400}, "top_logprobs"),
    (CHAT, json.dumps(chat(top_logprobs=2)), {400}, "top_logprobs"),
    (COMPLETIONS, json.dumps(completion(echo=True)), {400}, "echo"),
    (COMPLETIONS, json.dumps(completion(presence_penalty=0.5)), {400}, "presence_penalty"),
    (COMPLETIONS, json.dumps(completion(cache_salt="")), {400}, "cache_salt"),
    (COMPLETIONS, json.dumps(completion(cache_salt="s" * 257)), {400}, "cache_salt"),
    (CHAT, json.dumps(chat(messages=[])), {400}, "messages"),
    (COMPLETIONS, json.dumps(completion(prompt="x" * 70_000)), {400}, "prompt"),
    (COMPLETIONS, "[1, 2", {400}, None),
    (COMPLETIONS, json.dumps(completion(model="other")), {404}, "model"),
]


@pytest.fixture(scope="module")
def engine(model: Any, tokenizer: Any, request: pytest.FixtureRequest) -> Iterator[Engine]:
    """The engine under attack, with the shared Redis tier where Redis is installed."""
    config = engine_config(max_batch_size=4)
    if available() is None:
        config = with_remote(config, request.getfixturevalue("redis_cluster").url)
    with Engine(model, tokenizer, config) as engine:
        yield engine


@pytest.fixture(scope="module")
def server(engine: Engine) -> Iterator[ServerThread]:
    config = ServerConfig(api_keys=(KEY,), max_prompt_chars=65_536)
    running = ServerThread(create_app(engine, NAME, config))
    yield running
    running.stop()


def stream_tokens(server: ServerThread, prompt: str, started: threading.Event) -> list[str]:
    """One greedy streaming completion; the text of every chunk, in order."""
    texts: list[str] = []
    stream = server.client(max_retries=0).completions.create(
        model=NAME,
        prompt=prompt,
        max_tokens=40,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    for chunk in stream:
        texts.append(chunk.choices[0].text)
        started.set()
    return texts


def three_streams(server: ServerThread, during: Any = None) -> list[list[str]]:
    """Run the three streams together; call ``during()`` once the first has a token."""
    results: list[list[str] | BaseException] = [[], [], []]
    started = threading.Event()

    def run(i: int) -> None:
        try:
            results[i] = stream_tokens(server, STREAM_PROMPTS[i], started)
        except BaseException as exc:
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    if during is not None:
        assert started.wait(60)
        during()
    for thread in threads:
        thread.join(120)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results  # type: ignore[return-value]


@pytest.fixture(scope="module")
def reference(server: ServerThread) -> list[list[str]]:
    return three_streams(server)


@pytest.mark.parametrize(("path", "body", "statuses", "param"), POISON)
def test_poison_fails_alone(
    server: ServerThread,
    reference: list[list[str]],
    path: str,
    body: str,
    statuses: set[int],
    param: str | None,
) -> None:
    answer: dict[str, Any] = {}

    def poison() -> None:
        answer["reply"] = server.request("POST", path, body.encode())

    assert three_streams(server, poison) == reference
    status, reply = answer["reply"]
    assert status in statuses, reply
    if status >= 400:
        assert set(reply["error"]) == {"message", "type", "param", "code"}
        if param is not None:
            assert reply["error"]["param"] == param, reply
    after = server.client(max_retries=0).completions.create(
        model=NAME, prompt="After the poison,", max_tokens=3, temperature=0
    )
    assert after.choices[0].finish_reason in ("length", "stop")
    assert server.request("GET", "/health", key="") == (200, {"status": "ok"})
