"""A real uvicorn server around the engine, called with the official ``openai`` client."""

from __future__ import annotations

import http.client
import json
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import openai
import pytest

from kvtier import cli
from kvtier.engine import LLM, Engine, SamplingParams
from kvtier.server import create_app
from kvtier.server.config import ServerConfig
from tests.engine.tiny import FAULT_TOKEN, engine_config, inject_fault, reference_tokens
from tests.server.live import KEY, ServerThread

NAME = "tiny-llama"
MESSAGES = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "Name three colours of the rainbow."},
]


@pytest.fixture(scope="module")
def engine(model: Any, tokenizer: Any) -> Iterator[Engine]:
    with Engine(model, tokenizer, engine_config()) as engine:
        yield engine


@pytest.fixture(scope="module")
def server(engine: Engine) -> Iterator[ServerThread]:
    running = ServerThread(create_app(engine, NAME, ServerConfig(api_keys=(KEY,))))
    yield running
    running.stop()


def test_models_and_health(server: ServerThread) -> None:
    models = server.client().models.list()
    assert [m.id for m in models.data] == [NAME]
    assert server.request("GET", "/health", key="") == (200, {"status": "ok"})


def test_chat_equals_llm_and_transformers_streaming_or_not(
    server: ServerThread, engine: Engine, model: Any, tokenizer: Any
) -> None:
    client = server.client()
    reply = client.chat.completions.create(
        model=NAME, messages=MESSAGES, max_tokens=20, temperature=0
    )
    text = reply.choices[0].message.content
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage is not None and reply.usage.completion_tokens == 20
    stream = client.chat.completions.create(
        model=NAME,
        messages=MESSAGES,
        max_tokens=20,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 20
    # The second identical request adopted the first one's KV.
    details = chunks[-1].usage.prompt_tokens_details
    assert details is not None and details.cached_tokens and details.cached_tokens > 0
    assert streamed == text
    ids = engine.encode_chat(MESSAGES)
    expected = reference_tokens(model, ids, 20)
    assert text == tokenizer.decode(expected, skip_special_tokens=True)
    with LLM(model, tokenizer=tokenizer, config=engine_config()) as llm:
        [offline] = llm.generate([ids], SamplingParams(temperature=0, max_tokens=20))
    assert offline.token_ids == expected and offline.text == text


def test_completions_streaming_or_not(server: ServerThread, engine: Engine, model: Any) -> None:
    client = server.client()
    prompt = "The capital of France is"
    reply = client.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0)
    chunks = list(
        client.completions.create(
            model=NAME, prompt=prompt, max_tokens=12, temperature=0, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == reply.choices[0].text
    assert len(chunks) == 12  # one chunk per generated token, the last with the reason
    assert chunks[-1].choices[0].finish_reason == "length"
    expected = reference_tokens(model, engine.encode(prompt), 12)
    assert reply.choices[0].text == engine.tokenizer.decode(expected, skip_special_tokens=True)
    by_ids = client.completions.create(
        model=NAME, prompt=engine.encode(prompt), max_tokens=12, temperature=0
    )
    assert by_ids.choices[0].text == reply.choices[0].text
    stopped = client.completions.create(
        model=NAME, prompt=prompt, max_tokens=12, temperature=0, stop=reply.choices[0].text[4:8]
    )
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == reply.choices[0].text[:4]


CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
BAD_INPUTS = [
    # (path, body, status, param, words in the message)
    (CHAT, b'{"model": "tiny-llama", "messages": [', 400, None, "not valid JSON"),
    (CHAT, b"[1, 2]", 400, None, "JSON object"),
    (CHAT, {"model": NAME}, 400, "messages", "required"),
    (CHAT, {"model": NAME, "messages": []}, 400, "messages", "at least one message"),
    (CHAT, {"model": NAME, "messages": [{"role": "wizard", "content": "hi"}]}, 400,
     "messages[0].role", "'user'"),
    (CHAT, {"model": NAME, "messages": [{"role": "user", "content": 7}]}, 400,
     "messages[0].content", "a string or a list of text parts"),
    (CHAT, {"model": NAME, "messages": MESSAGES, "temperature": "hot"}, 400, "temperature",
     "number"),
    (CHAT, {"model": NAME, "messages": MESSAGES, "max_tokens": "5"}, 400, "max_tokens",
     "integer"),
    (CHAT, {"model": NAME, "messages": MESSAGES, "temperature": -1}, 400, "temperature", "[0, 2]"),
    (CHAT, {"model": NAME, "messages": MESSAGES, "top_p": 0}, 400, "top_p", "(0, 1]"),
    (CHAT, {"model": NAME, "messages": MESSAGES, "n": 2}, 400, "n", "n=1"),
    (CHAT, {"model": NAME, "messages": MESSAGES, "stop": 5}, 400, "stop", "a string"),
    (CHAT, {"model": "gpt-4o", "messages": MESSAGES}, 404, "model", "does not exist"),
    (COMPLETIONS, {"model": NAME, "prompt": [5] * 2040, "max_tokens": 16}, 400, "max_tokens",
     "maximum context length is 2048"),
    (COMPLETIONS, {"model": NAME, "prompt": "x " * 3000}, 400, "prompt", "maximum context"),
    (COMPLETIONS, {"model": NAME, "prompt": ""}, 400, "prompt", "at least one token"),
    (COMPLETIONS, {"model": NAME, "prompt": ["a", "b"]}, 400, "prompt", "one prompt"),
    (COMPLETIONS, {"model": NAME, "prompt": [1, "a"]}, 400, "prompt", "list of token ids"),
    ("/v1/embeddings", {"model": NAME, "input": "x"}, 404, None, "no route"),
]  # fmt: skip


@pytest.mark.parametrize(("path", "body", "status", "param", "words"), BAD_INPUTS)
def test_bad_input_gets_a_4xx_and_the_server_keeps_serving(
    server: ServerThread, path: str, body: Any, status: int, param: str | None, words: str
) -> None:
    got, reply = server.request("POST", path, body)
    assert got == status, reply
    error = reply["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and words in error["message"], error
    ok, answer = server.request(
        "POST", COMPLETIONS, {"model": NAME, "prompt": "Hi", "max_tokens": 2}
    )
    assert ok == 200 and answer["choices"][0]["finish_reason"] == "length"


def test_api_key_is_required_on_v1_routes(server: ServerThread) -> None:
    body = {"model": NAME, "prompt": "Hi", "max_tokens": 2}
    status, reply = server.request("POST", COMPLETIONS, body, key="")
    assert status == 401 and reply["error"]["code"] == "invalid_api_key"
    assert server.request("POST", COMPLETIONS, b"{bad json", key="wrong")[0] == 401
    with pytest.raises(openai.AuthenticationError):
        server.client(api_key="wrong", max_retries=0).models.list()
    assert server.request("GET", "/metrics", key="")[0] == 200
    assert server.request("POST", COMPLETIONS, body)[0] == 200


def test_wrong_method_answers_405_with_allow(server: ServerThread) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    conn.request("GET", "/v1/completions", headers={"Authorization": f"Bearer {KEY}"})
    response = conn.getresponse()
    body = json.loads(response.read())
    conn.close()
    assert response.status == 405 and response.getheader("Allow") == "POST"
    assert set(body["error"]) == {"message", "type", "param", "code"}


def test_full_queue_answers_429_then_serves_again(model: Any, tokenizer: Any) -> None:
    with Engine(model, tokenizer, engine_config(max_queued=1, max_batch_size=1)) as engine:
        server = ServerThread(create_app(engine, NAME))
        try:
            client = server.client(max_retries=0)
            slow = dict(model=NAME, prompt="Once", max_tokens=1900, temperature=0, stream=True)
            running = client.completions.create(**slow, extra_body={"ignore_eos": True})
            next(iter(running))  # generating now: the queue is empty again
            waiting = client.completions.create(**slow)  # queued (headers come at once)
            with pytest.raises(openai.RateLimitError) as info:
                client.completions.create(model=NAME, prompt="Hi", max_tokens=2)
            assert info.value.status_code == 429
            assert "queue is full" in info.value.message
            assert int(info.value.response.headers["Retry-After"]) >= 1
            running.close()  # clients going away cancel their requests
            waiting.close()
            deadline = time.monotonic() + 10
            while engine.stats().requests_cancelled < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
            reply = client.completions.create(model=NAME, prompt="Hi", max_tokens=2)
            assert reply.choices[0].finish_reason == "length"
            stats = engine.stats()
            assert stats.requests_rejected == 1 and stats.requests_cancelled == 2
        finally:
            server.stop()


def test_metrics_expose_tiers_links_queue_and_latency(server: ServerThread) -> None:
    server.client().completions.create(model=NAME, prompt="Hello there", max_tokens=4)
    status, text = server.request("GET", "/metrics", key="")
    assert status == 200
    for name in (
        'kvtier_tier_hits_total{tier="host"}',
        'kvtier_tier_hits_total{tier="device"}',
        'kvtier_tier_eviction_policy{policy="lru",tier="host"} 1.0',
        'kvtier_tier_codec{codec="raw",tier="host"} 1.0',
        "kvtier_tier_bytes_in_total",
        "kvtier_tier_bytes_out_total",
        "kvtier_tier_evictions_total",
        "kvtier_tier_used_bytes",
        "kvtier_link_gbps",
        "kvtier_link_bytes_total",
        "kvtier_link_stall_seconds_total",
        "kvtier_queue_depth 0.0",
        "kvtier_requests_running",
        'kvtier_requests_total{outcome="finished"}',
        "kvtier_prompt_tokens_total",
        "kvtier_generation_tokens_total",
        "kvtier_reused_tokens_total",
        'kvtier_time_to_first_token_seconds_bucket{le="+Inf"}',
        "kvtier_time_to_first_token_seconds_sum",
        'kvtier_inter_token_latency_seconds_bucket{le="0.01"}',
        "kvtier_inter_token_latency_seconds_count",
    ):
        assert name in text, name


def test_metrics_count_the_chunk_reads_by_decision(server: ServerThread) -> None:
    prompt = " ".join(f"word{i}" for i in range(120))  # several sealed chunks
    server.client().completions.create(model=NAME, prompt=prompt, max_tokens=3)
    _, text = server.request("GET", "/metrics", key="")
    line = next(x for x in text.splitlines() if x.startswith("kvtier_decision_chunks_total{"))
    assert float(line.split()[-1]) > 0
    assert 'kvtier_decision_bytes_total{decision="' in text


CLIENTS = 64


def test_concurrent_streaming_clients_all_complete(server: ServerThread, engine: Engine) -> None:
    system = "You answer questions about numbers in one short sentence, politely."

    def ask(i: int) -> tuple[str, str | None, int]:
        client = server.client(max_retries=0, timeout=120)
        stream = client.chat.completions.create(
            model=NAME,
            messages=[
                {"role": "system", "content": system},
                {"role": "user", "content": f"What is {i} times {i}?"},
            ],
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        text, reason, tokens = "", None, 0
        for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                reason = chunk.choices[0].finish_reason or reason
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        return text, reason, tokens

    before = engine.stats().requests_finished
    with ThreadPoolExecutor(CLIENTS) as pool:
        results = list(pool.map(ask, range(CLIENTS)))
    assert engine.stats().requests_finished - before == CLIENTS
    # Memory stayed within the configured budgets: the caches reserved at start, each
    # within its device budget at its peak, the host tier within its capacity.
    config = engine.config
    assert len(engine.caches) == config.max_running > 1
    for cache in engine.caches:
        assert cache.peak_device_nbytes <= config.cache.device_budget_bytes
        assert cache.staging_nbytes <= config.cache.staging_bytes
    stats = engine.stats()
    assert stats.cache is not None
    assert stats.cache.device_budget_bytes <= config.total_device_budget_bytes
    assert engine.manager.host.used_bytes <= engine.manager.host.capacity_bytes
    assert stats.max_decode_batch > 1  # the clients were served together
    for i, (text, reason, tokens) in enumerate(results):
        ids = engine.encode_chat(
            [
                {"role": "system", "content": system},
                {"role": "user", "content": f"What is {i} times {i}?"},
            ]
        )
        expected = engine.submit(ids, SamplingParams(temperature=0, max_tokens=8)).result()
        assert (text, reason, tokens) == (
            expected.text,
            expected.finish_reason,
            len(expected.token_ids),
        )


def test_serve_command_reports_a_busy_port_in_one_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert cli.main(["serve", "--port", str(port)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"cannot listen on 127.0.0.1:{port}" in err
    assert cli.main(["serve", "--max-queued", "0"]) == 2
    assert "--max-queued: must be >= 1" in capsys.readouterr().err
    assert cli.main(["serve", "--prefill-tokens-per-step", "0"]) == 2
    assert "--prefill-tokens-per-step: must be >= 1" in capsys.readouterr().err


def test_a_failed_generation_is_reported_and_the_server_serves_on(
    model: Any, tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    inject_fault(monkeypatch, model)
    with Engine(model, tokenizer, engine_config()) as engine:
        server = ServerThread(create_app(engine, NAME))
        try:
            body = {"model": NAME, "prompt": [FAULT_TOKEN] * 40, "max_tokens": 4}
            status, reply = server.request("POST", COMPLETIONS, body)
            assert status == 500 and reply["error"]["code"] == "generation_failed"
            assert "injected fault" in reply["error"]["message"]
            client = server.client(max_retries=0)
            with pytest.raises(openai.APIError, match="generation failed"):
                list(client.completions.create(**body, stream=True))
            reply = client.completions.create(model=NAME, prompt="Hi", max_tokens=2)
            assert reply.choices[0].finish_reason == "length"
        finally:
            server.stop()


def test_a_request_the_tiers_cannot_hold_gets_a_400(model: Any, tokenizer: Any) -> None:
    # Two host chunks cannot hold a 25-chunk context the device cannot hold either.
    with Engine(model, tokenizer, engine_config(host_chunks=2)) as engine:
        server = ServerThread(create_app(engine, NAME))
        try:
            body = {"model": NAME, "prompt": list(range(100, 500)), "max_tokens": 4}
            status, reply = server.request("POST", COMPLETIONS, body)
            assert status == 400 and reply["error"]["code"] == "context_length_exceeded"
            assert "enlarge the host tier" in reply["error"]["message"]
            status, _ = server.request("POST", COMPLETIONS, {**body, "prompt": "Hi"})
            assert status == 200
        finally:
            server.stop()
