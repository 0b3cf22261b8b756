"""The OpenAI wire format: request models (validated strictly) and response bodies.

Field names follow OpenAI's API. Types are strict (``"5"`` is not a number), fields this
server does not know are ignored, known fields outside their range are rejected with the
field's name, and known fields whose feature this server lacks (``echo``, penalties,
``logit_bias``…) are refused when set, never silently ignored. Strings must be
valid Unicode (a lone surrogate such as ``"\ud800"`` is refused). Extensions: ``top_k``,
``ignore_eos`` and ``cache_salt`` (vLLM's name: requests reuse KV only from requests with
the same salt).
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kvtier.engine import Completion, ParamError, SamplingParams
from kvtier.engine.request import MAX_STOP_STRINGS

# What a union-typed field accepts, for error messages (pydantic reports each member).
EXPECTED = {
    "prompt": "a string or a list of token ids",
    "stop": "a string, a list of strings, or null",
    "content": "a string or a list of text parts",
}

# OpenAI's default for /v1/completions; chat completions default to the rest of the context.
DEFAULT_COMPLETION_TOKENS = 16
MAX_SALT_CHARS = 256


def check_text(param: str, text: str) -> None:
    """Refuse a string that is not valid Unicode (a lone surrogate from a JSON escape)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ParamError(
            param, f"is not valid Unicode (a lone surrogate at character {exc.start})"
        ) from None


# Validation must cost little whatever the body holds: a union tries every member, and a
# list member reports one error per bad item (2M bad items in an 8 MB body took pydantic
# 52 s of the event loop). So every list is bounded (``max_length`` is checked before the
# items) and stops at its first bad item (``fail_fast``).
MAX_PROMPT_IDS = 1 << 20
MAX_PROMPTS = 64  # a list of prompts: refused past one, with a message (single_prompt)
MAX_MESSAGES = 1 << 16
MAX_PARTS = 1 << 16
MAX_LOGIT_BIAS = 300

TokenIds = Annotated[list[int], Field(max_length=MAX_PROMPT_IDS, fail_fast=True)]
TextPrompts = Annotated[list[str], Field(max_length=MAX_PROMPTS, fail_fast=True)]
IdPrompts = Annotated[list[TokenIds], Field(max_length=MAX_PROMPTS, fail_fast=True)]
StopStrings = Annotated[list[str], Field(max_length=MAX_STOP_STRINGS, fail_fast=True)]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    """Fields shared by completions and chat completions."""

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop: str | StopStrings | None = None
    seed: int | None = None
    n: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = None
    cache_salt: str | None = None
    user: str | None = None
    # Known OpenAI fields this server does not implement: refused when set (see check).
    echo: bool | None = None
    best_of: int | None = None
    suffix: str | None = None
    logit_bias: Annotated[dict[str, float], Field(max_length=MAX_LOGIT_BIAS)] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None

    def check(self) -> None:
        """Checks pydantic cannot express; ``ParamError`` names the field."""
        for name, value, default in (
            ("echo", self.echo, False),
            ("best_of", self.best_of, 1),
            ("suffix", self.suffix, ""),
            ("logit_bias", self.logit_bias, {}),
            ("presence_penalty", self.presence_penalty, 0),
            ("frequency_penalty", self.frequency_penalty, 0),
        ):
            if value is not None and value != default:
                raise ParamError(
                    name, f"is not supported by this server (send {default!r} or omit it)"
                )
        if self.cache_salt is not None:
            check_text("cache_salt", self.cache_salt)
            if not 0 < len(self.cache_salt) <= MAX_SALT_CHARS:
                raise ParamError(
                    "cache_salt", f"must be 1 to {MAX_SALT_CHARS} characters, or omitted"
                )
        if self.user is not None:
            check_text("user", self.user)
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        for i, stop in enumerate(stops):
            check_text(f"stop[{i}]" if isinstance(self.stop, list) else "stop", stop)

    def logprobs_count(self) -> int | None:
        """Alternatives per token the client wants log-probabilities of (None: none)."""
        return None

    def params(self, max_tokens: int) -> SamplingParams:
        """The engine's sampling parameters; ``ParamError`` names a field out of range."""
        if self.n not in (None, 1):
            raise ParamError("n", f"only n=1 is supported, got {self.n}")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return SamplingParams(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            max_tokens=max_tokens,
            stop=stop,
            seed=self.seed,
            ignore_eos=bool(self.ignore_eos),
            logprobs=self.logprobs_count(),
        )

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_Sampling):
    """``POST /v1/completions``; one prompt (a one-element list is accepted)."""

    prompt: str | TokenIds | TextPrompts | IdPrompts
    logprobs: int | None = None

    def logprobs_count(self) -> int | None:
        return self.logprobs

    def check(self) -> None:
        super().check()
        prompt = self.prompt
        texts = [prompt] if isinstance(prompt, str) else [p for p in prompt if isinstance(p, str)]
        for text in texts:
            check_text("prompt", text)

    def single_prompt(self) -> str | list[int]:
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise ParamError("prompt", "send one prompt per request (batches unsupported)")
            return prompt[0]
        return prompt  # type: ignore[return-value]


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | Annotated[list[TextPart], Field(max_length=MAX_PARTS, fail_fast=True)] | None = (
        None
    )

    def texts(self) -> list[str]:
        content = self.content
        if isinstance(content, list):
            return [p.text for p in content]
        return [content] if content else []

    def as_template_message(self) -> dict[str, str]:
        content = self.content
        text = "".join(p.text for p in content) if isinstance(content, list) else content or ""
        # Chat templates know "system"; "developer" is OpenAI's newer name for it.
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``."""

    messages: Annotated[list[ChatMessage], Field(max_length=MAX_MESSAGES, fail_fast=True)]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None

    def logprobs_count(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise ParamError("top_logprobs", "needs logprobs: true")
        return (self.top_logprobs or 0) if self.logprobs else None

    def check(self) -> None:
        super().check()
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= 20:
            raise ParamError(
                "top_logprobs", f"must be an integer in [0, 20], got {self.top_logprobs}"
            )
        for i, message in enumerate(self.messages):
            for text in message.texts():
                check_text(f"messages[{i}].content", text)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage_body(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """OpenAI's usage object; ``cached_tokens`` are the prompt tokens reused from the tiers."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def completion_body(
    request_id: str, model: str, completion: Completion, logprobs: dict[str, Any] | None = None
) -> dict[str, Any]:
    return {
        "id": request_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "text": completion.text,
                "logprobs": logprobs,
                "finish_reason": completion.finish_reason,
            }
        ],
        "usage": _usage_of(completion),
    }


def chat_body(
    request_id: str, model: str, completion: Completion, logprobs: dict[str, Any] | None = None
) -> dict[str, Any]:
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": completion.text},
                "logprobs": logprobs,
                "finish_reason": completion.finish_reason,
            }
        ],
        "usage": _usage_of(completion),
    }


def completion_chunk(
    request_id: str,
    model: str,
    text: str,
    finish_reason: str | None,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    return {
        "id": request_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
    }


def chat_chunk(
    request_id: str,
    model: str,
    delta: dict[str, str],
    finish_reason: str | None,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    return {
        "id": request_id,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
    }


def usage_chunk(request_id: str, model: str, obj: str, body: dict[str, Any]) -> dict[str, Any]:
    """The last chunk of a stream with ``stream_options.include_usage``: no choices."""
    return {
        "id": request_id,
        "object": obj,
        "created": int(time.time()),
        "model": model,
        "choices": [],
        "usage": body,
    }


def _usage_of(completion: Completion) -> dict[str, Any]:
    return usage_body(
        len(completion.prompt_ids), len(completion.token_ids), completion.reused_tokens
    )
