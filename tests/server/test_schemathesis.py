"""Schemathesis against the server's own ``/openapi.json``: no 5xx, every answer as documented.

A real uvicorn server over the tiny random-weight engine, with an API key (``/metrics``
guarded too) and the shared Redis tier (where Redis is installed). For each operation
schemathesis sends its coverage phase (boundary and type-violating values of every field,
deterministic) and hypothesis-generated bodies, valid and invalid. A case hook sends the
served model name and caps the tokens asked for, so each case costs a few decode steps:
the file runs in under a minute on two cores.

A failure names the check and carries the curl command that reproduces it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import Case, GenerationMode, HookContext
from schemathesis.checks import not_a_server_error
from schemathesis.generation.drivers import CoverageGenerator
from schemathesis.generation.feedback import FeedbackSources
from schemathesis.generation.overrides import Override
from schemathesis.schemas import APIOperation, BaseSchema
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    ignored_auth,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from kvbench.redis_cluster import available
from kvtier.engine import Engine
from kvtier.server import create_app
from kvtier.server.config import ServerConfig
from tests.engine.tiny import engine_config, with_remote
from tests.server.test_server import KEY, NAME, ServerThread

pytestmark = pytest.mark.slow  # the slow phase of make test

MAX_TOKENS = 4  # the most tokens a generated request may ask for
EXAMPLES = 150  # hypothesis cases per operation and mode (the coverage phase adds its own)
AUTH = {"Authorization": f"Bearer {KEY}"}
CONFIG = ServerConfig(api_keys=(KEY,), metrics_need_key=True)
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    response_headers_conformance,
    ignored_auth,  # a request without the key gets a 401
]
GETS = ["/health", "/metrics", "/v1/models"]
POSTS = ["/v1/completions", "/v1/chat/completions"]
POSITIVE, NEGATIVE = GenerationMode.POSITIVE, GenerationMode.NEGATIVE


def map_case(context: HookContext, case: Case) -> Case:
    """Send the served model name, and at most ``MAX_TOKENS`` tokens (invalid counts stay)."""
    body = case.body
    if not isinstance(body, dict):
        return case
    if isinstance(body.get("model"), str):
        body["model"] = NAME
    for field in ("max_tokens", "max_completion_tokens"):
        value = body.get(field)
        if isinstance(value, int) and not isinstance(value, bool) and value > MAX_TOKENS:
            body[field] = value % MAX_TOKENS + 1
    if not body.get("max_completion_tokens") and body.get("max_tokens") is None:
        body["max_tokens"] = MAX_TOKENS  # else chat completions run to the end of the context
    return case


@pytest.fixture(scope="module")
def api(model: Any, tokenizer: Any, request: pytest.FixtureRequest) -> Iterator[BaseSchema]:
    """The server's document, loaded from the running server that its cases call; with
    the shared tier on the session's Redis Cluster where Redis is installed."""
    config = engine_config()
    if available() is None:
        config = with_remote(config, request.getfixturevalue("redis_cluster").url)
    with Engine(model, tokenizer, config) as engine:
        server = ServerThread(create_app(engine, NAME, CONFIG))
        try:
            config = schemathesis.Config.from_dict({"request-timeout": 30, "headers": AUTH})
            url = f"http://127.0.0.1:{server.port}/openapi.json"
            schema = schemathesis.openapi.from_url(url, config=config)
            schema.hook(map_case)
            yield schema
        finally:
            server.stop()


def call_and_validate(case: Case) -> None:
    try:
        case.call_and_validate(checks=CHECKS)
    except BaseException as exc:
        exc.add_note(f"reproduce with: {case.as_curl_command()}")
        raise


@pytest.mark.parametrize(
    ("path", "mode"),
    [(path, POSITIVE) for path in GETS]
    + [(path, mode) for path in POSTS for mode in (POSITIVE, NEGATIVE)],
)
def test_generated_requests(api: BaseSchema, path: str, mode: GenerationMode) -> None:
    operation = api[path]["POST" if path in POSTS else "GET"]

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    def answers_as_documented(case: Case) -> None:
        call_and_validate(case)

    answers_as_documented()


@pytest.mark.parametrize("path", POSTS)
def test_coverage_phase(api: BaseSchema, path: str) -> None:
    """Every field at its boundaries and with each wrong type, plus missing fields."""
    operation: APIOperation = api[path]["POST"]
    cases = CoverageGenerator(
        operation=operation,
        generation_modes=[POSITIVE, NEGATIVE],
        generation_config=api.config.generation_for(operation=operation, phase="coverage"),
        auth_storage=None,
        override=Override(headers=AUTH),
        feedback=FeedbackSources(),
    )
    sent = 0
    for case in cases:
        call_and_validate(case)
        sent += 1
    assert sent > 100  # the phase really ran
