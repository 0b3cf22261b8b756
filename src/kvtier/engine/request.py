"""Requests and what flows back from them: sampling parameters, token events, handles.

A ``Request`` is immutable once submitted. The engine streams its output as ``TokenEvent``s
into the request's ``RequestHandle``; the caller consumes them from any thread (``for
event in handle``) or from an asyncio loop (``async for event in handle.events()``).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import AsyncGenerator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal

from kvtier.validate import is_int, is_number

FinishReason = Literal["stop", "length", "cancelled"]

# The ranges every request is checked against before any work (OpenAI's where it has one).
MAX_TEMPERATURE = 2.0
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed takes
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_LOGPROBS = 20  # alternatives per token (OpenAI's top_logprobs limit)


class ParamError(ValueError):
    """A request parameter is out of range; ``param`` names the field (for API errors)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


class ContextLengthError(ParamError):
    """Prompt plus ``max_tokens`` do not fit in the model's context."""


class QueueFullError(RuntimeError):
    """``Engine.submit`` found the admission queue full; retry later (HTTP 429).

    Attributes:
        retry_after_s: the engine's estimate of when a retry may be admitted.
    """

    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class EngineClosedError(RuntimeError):
    """The engine is closed or closing and accepts no new requests (HTTP 503)."""


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop.

    Attributes:
        temperature: 0 picks the most likely token (greedy); higher values flatten the
            distribution.
        top_p: nucleus sampling: keep the smallest set of tokens whose probability sums to
            at least ``top_p`` (1 keeps all).
        top_k: keep the ``top_k`` most likely tokens (0 keeps all).
        max_tokens: most tokens to generate.
        stop: strings that end the output; the output is cut before the first one.
        seed: seeds the request's own random generator, so sampling reproduces; None
            draws a fresh seed. Any integer the generator takes: ``[-2**63, 2**64 - 1]``.
        ignore_eos: keep generating past the tokenizer's end-of-sequence token.
        logprobs: None: no log-probabilities; ``k`` (0 to 20): each generated token comes
            with its log-probability and the ``k`` most likely tokens' (the model's
            distribution: log-softmax of the raw logits, before temperature and filters).

    Every accepted value samples without error: ranges are checked here, before any work,
    and ``kvtier.engine.sampling.sample`` cannot underflow for any of them.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 16
    stop: tuple[str, ...] = ()
    seed: int | None = None
    ignore_eos: bool = False
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif not isinstance(self.stop, tuple):
            object.__setattr__(self, "stop", tuple(self.stop))
        if not is_number(self.temperature) or not 0 <= self.temperature <= MAX_TEMPERATURE:
            raise ParamError(
                "temperature",
                f"must be a finite number in [0, {MAX_TEMPERATURE:g}], got {self.temperature!r}",
            )
        if not is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ParamError("top_p", f"must be a number in (0, 1], got {self.top_p!r}")
        if not is_int(self.top_k) or self.top_k < 0:
            raise ParamError("top_k", f"must be an integer >= 0 (0: off), got {self.top_k!r}")
        if not is_int(self.max_tokens) or self.max_tokens < 1:
            raise ParamError("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ParamError(
                "stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}"
            )
        if any(not isinstance(s, str) or not 0 < len(s) <= MAX_STOP_CHARS for s in self.stop):
            raise ParamError(
                "stop", f"must be non-empty strings of at most {MAX_STOP_CHARS} characters"
            )
        if self.seed is not None and (
            not is_int(self.seed) or not SEED_MIN <= self.seed <= SEED_MAX
        ):
            raise ParamError(
                "seed", f"must be an integer in [{SEED_MIN}, {SEED_MAX}] or null, got {self.seed!r}"
            )

        if self.logprobs is not None and (
            not is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            raise ParamError(
                "logprobs",
                f"must be an integer in [0, {MAX_LOGPROBS}] or null, got {self.logprobs!r}",
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class Request:
    """One generation request.

    Attributes:
        request_id: unique per engine.
        prompt_ids: the prompt's token ids (at least one).
        params: sampling and stopping.
        cache_salt: the tenant's salt: KV is reused only between requests with the same
            salt (empty: the engine's shared namespace).
        arrival_s: ``time.perf_counter()`` at submission (TTFT counts from here).
    """

    request_id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    cache_salt: str = ""
    arrival_s: float = field(default_factory=time.perf_counter)


@dataclass(frozen=True)
class TokenLogprobs:
    """A generated token's log-probability, and the most likely tokens' at its position.

    Attributes:
        logprob: natural log of the token's probability under the model.
        top: ``(token id, logprob)`` of the most likely tokens, most likely first
            (``SamplingParams.logprobs`` of them; may or may not include the token).
    """

    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class TokenEvent:
    """One generated token, or the end of a request.

    Attributes:
        request_id: the request.
        token_id: the generated token; None on a final event without a token (a request
            cancelled before its next token).
        text: the text this token adds (may be empty: a token can end inside a UTF-8
            character, and text that could start a stop string is held back until it
            cannot).
        finished: the last event of the request.
        finish_reason: ``stop`` (a stop string or the end-of-sequence token), ``length``
            (``max_tokens``) or ``cancelled``; None until finished.
        logprobs: the token's log-probabilities when the request asked for them.
    """

    request_id: str
    token_id: int | None
    text: str
    finished: bool = False
    finish_reason: FinishReason | None = None
    logprobs: TokenLogprobs | None = None


@dataclass(frozen=True)
class Completion:
    """The whole output of a finished request.

    Attributes:
        request_id: the request.
        prompt_ids: the prompt's token ids.
        token_ids: the generated token ids (the end-of-sequence token included when it
            ended the request).
        text: the generated text, cut before a stop string.
        finish_reason: why it ended.
        reused_tokens: prompt tokens whose KV came from the tiers instead of a forward.
        logprobs: one entry per generated token when the request asked for them.
    """

    request_id: str
    prompt_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None
    reused_tokens: int
    logprobs: list[TokenLogprobs] | None = None


class RequestHandle:
    """The caller's side of a submitted request: its events, and a way to cancel it.

    The engine's worker thread appends events; one consumer reads them, either by
    iterating (blocks the calling thread) or with ``events()`` (an async iterator that
    never blocks the loop). Events are buffered without bound, so a slow consumer never
    stalls the engine. All methods are thread-safe.

    Attributes:
        request: the request.
        reused_tokens: prompt tokens adopted from the tiers; set before the first event.
        predicted_s: its predicted engine seconds, set when it is queued (admission by
            cost, ``kvtier.engine.handoff``).
    """

    def __init__(self, request: Request) -> None:
        self.request = request
        self.reused_tokens = 0
        self.predicted_s = 0.0
        self._cond = threading.Condition()
        self._events: deque[TokenEvent] = deque()
        self._done = False
        self._error: BaseException | None = None
        self._cancelled = threading.Event()
        self._waker: tuple[asyncio.AbstractEventLoop, asyncio.Event] | None = None

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    @property
    def done(self) -> bool:
        """The engine has delivered the final event (or failed); events may remain unread."""
        with self._cond:
            return self._done

    def cancel(self) -> None:
        """Ask the engine to stop this request; it ends with ``finish_reason="cancelled"``.

        Takes effect before the next token (or at admission when still queued). A no-op
        once the request has finished.
        """
        self._cancelled.set()

    def __iter__(self) -> Iterator[TokenEvent]:
        """Yield events as they arrive, blocking; raises what the engine raised, if any."""
        while True:
            with self._cond:
                while not self._events and not self._done:
                    self._cond.wait()
                if self._events:
                    event = self._events.popleft()
                elif self._error is not None:
                    raise self._error
                else:
                    return
            yield event

    async def events(self) -> AsyncGenerator[TokenEvent, None]:
        """Yield events as they arrive without blocking the running event loop."""
        loop = asyncio.get_running_loop()
        ready = asyncio.Event()
        with self._cond:
            self._waker = (loop, ready)
        while True:
            with self._cond:
                batch = list(self._events)
                self._events.clear()
                done, error = self._done, self._error
                if not batch and not done:
                    # Cleared under the lock: a producer appending after this schedules a
                    # set() that runs after this clear() on the loop.
                    ready.clear()
            for event in batch:
                yield event
            if not batch:
                if done:
                    if error is not None:
                        raise error
                    return
                await ready.wait()

    def result(self) -> Completion:
        """Block until the request finishes; returns everything it produced."""
        return self.completion_of(list(self))

    def completion_of(self, events: Sequence[TokenEvent]) -> Completion:
        """The ``Completion`` that ``events`` (all of this request's) add up to."""
        token_ids = [e.token_id for e in events if e.token_id is not None]
        logprobs = [e.logprobs for e in events if e.logprobs is not None]
        return Completion(
            self.request_id,
            list(self.request.prompt_ids),
            token_ids,
            "".join(e.text for e in events),
            events[-1].finish_reason if events else None,
            self.reused_tokens,
            logprobs if self.request.params.logprobs is not None else None,
        )

    # ---- producer side (the engine) -------------------------------------------------------

    def put(self, event: TokenEvent) -> None:
        """Append an event (engine only); a ``finished`` event ends the stream."""
        with self._cond:
            if self._done:
                return
            self._events.append(event)
            self._done = event.finished
            self._cond.notify_all()
            self._wake()

    def fail(self, error: BaseException) -> None:
        """End the stream with an error that consumers re-raise (engine only)."""
        with self._cond:
            if self._done:
                return
            self._error = error
            self._done = True
            self._cond.notify_all()
            self._wake()

    def _wake(self) -> None:
        if self._waker is None:
            return
        loop, ready = self._waker
        try:
            loop.call_soon_threadsafe(ready.set)
        except RuntimeError:  # the consumer's loop is closed: nobody is listening
            self._waker = None


def as_prompt_ids(prompt_ids: Sequence[int]) -> tuple[int, ...]:
    """Validate token ids given by a caller."""
    ids = tuple(prompt_ids)
    if not ids:
        raise ParamError("prompt", "must have at least one token")
    if any(not is_int(t) or t < 0 for t in ids):
        raise ParamError("prompt", "token ids must be integers >= 0")
    return ids
