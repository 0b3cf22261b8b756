"""Log-probabilities in OpenAI's two wire formats.

``/v1/completions`` (``logprobs: k``) answers with the legacy columns: ``tokens``,
``token_logprobs``, ``top_logprobs`` (one ``{token text: logprob}`` per token: the ``k``
most likely and the sampled one) and ``text_offset`` (each token's first character in the
output). ``/v1/chat/completions`` (``logprobs: true``, ``top_logprobs: k``) answers with
``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}``. Values are the
model's distribution (log-softmax of the raw logits), as ``TokenLogprobs`` carries them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from kvtier.engine import TokenLogprobs

TokenText = Callable[[int], str]
"""The text of one token id (special tokens included)."""


class CompletionLogprobs:
    """Builds the legacy ``logprobs`` object, token by token (the text offsets carry over
    from one streamed chunk to the next). One per request; not thread-safe."""

    def __init__(self, token_text: TokenText) -> None:
        self.token_text = token_text
        self.offset = 0

    def of(self, entries: Sequence[tuple[int, TokenLogprobs]]) -> dict[str, Any]:
        tokens: list[str] = []
        values: list[float] = []
        tops: list[dict[str, float]] = []
        offsets: list[int] = []
        for token_id, lp in entries:
            text = self.token_text(token_id)
            top = {self.token_text(t): v for t, v in lp.top}
            top.setdefault(text, lp.logprob)
            tokens.append(text)
            values.append(lp.logprob)
            tops.append(top)
            offsets.append(self.offset)
            self.offset += len(text)
        return {
            "tokens": tokens,
            "token_logprobs": values,
            "top_logprobs": tops,
            "text_offset": offsets,
        }


def chat_logprobs(
    entries: Sequence[tuple[int, TokenLogprobs]], token_text: TokenText
) -> dict[str, Any]:
    """The chat ``logprobs`` object of these tokens."""

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text = token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    content = [
        {**entry(t, lp.logprob), "top_logprobs": [entry(i, v) for i, v in lp.top]}
        for t, lp in entries
    ]
    return {"content": content}
