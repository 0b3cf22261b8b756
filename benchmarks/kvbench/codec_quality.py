"""What a lossy chunk codec does to a model's tokens (``kvtier bench codec``'s quality part).

Method: for each sequence, the KV of every sealed chunk goes through the codec (encode, then
decode: what a promotion from a compressed tier hands back) as soon as it is sealed, the
prompt's chunks after the prefill and each continuation chunk after its forward; the
continuation is teacher-forced (the same tokens for every codec), so every position's
next-token distribution is compared with the raw run's at the same position: greedy-token
agreement (argmax equal) and the mean KL(raw || codec). Worst case for a tiered cache: every
chunk but the open tail came back through the codec. The pass-key check generates answers
greedily from documents whose chunks all went through the codec (``pass_key_answers`` says
at which length the embedded model finds the key at all).
"""

from __future__ import annotations

import copy
import inspect
import math
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache

from kvtier.codec import Codec
from kvtier.kv.layout import KVLayout


@dataclass(frozen=True)
class Quality:
    """One codec on one model, over every continuation position.

    Attributes:
        token_agreement: share of positions whose greedy token equals raw's.
        mean_kl: mean KL(raw || codec) of the next-token distributions, nats.
        positions: positions compared.
    """

    token_agreement: float
    mean_kl: float
    positions: int


@torch.inference_mode()
def round_trip(cache: DynamicCache, layout: KVLayout, codec: Codec, start: int, end: int) -> None:
    """Replace the KV of tokens ``[start, end)`` (whole chunks) of every row of ``cache`` by
    its codec round trip, one chunk ``[L, 2, H, T, D]`` at a time. Mutates ``cache``."""
    size = layout.chunk_tokens
    layers = kv_layers(cache)
    device = layers[0].keys.device  # the codec runs where the cache is (torch on CUDA)
    chunk = layout.empty_chunk(device)
    encoded = torch.empty(codec.encoded_nbytes(layout), dtype=torch.uint8, device=device)
    batch = layers[0].keys.shape[0]
    for row in range(batch):
        for a in range(start, end, size):
            for i, layer in enumerate(layers):  # keys/values [B, H, S, D]
                chunk[i, 0].copy_(layer.keys[row, :, a : a + size])
                chunk[i, 1].copy_(layer.values[row, :, a : a + size])
            codec.encode_into(chunk, encoded)
            codec.decode_into(encoded, chunk)
            for i, layer in enumerate(layers):
                layer.keys[row, :, a : a + size].copy_(chunk[i, 0])
                layer.values[row, :, a : a + size].copy_(chunk[i, 1])


def kv_layers(cache: DynamicCache) -> list[Any]:
    """The cache's layers, each with ``keys`` and ``values`` ``[B, H, S, D]``."""
    return list(cache.layers)


@torch.inference_mode()
def continuation_logprobs(
    model: Any, layout: KVLayout, ids: torch.Tensor, prompt_tokens: int, codec: Codec | None
) -> torch.Tensor:
    """Log-probabilities ``[B, C, V]`` at the continuation's positions of ``ids`` ``[B, P +
    C]`` (``P``, ``C`` whole chunks), every sealed chunk round-tripped through ``codec``
    (None: raw, untouched)."""
    cache = DynamicCache(config=model.config)
    model(ids[:, :prompt_tokens], cache=cache, use_cache=True)
    if codec is not None:
        round_trip(cache, layout, codec, 0, prompt_tokens)
    size = layout.chunk_tokens
    out = []
    for a in range(prompt_tokens, ids.shape[1], size):
        logits = model(ids[:, a : a + size], cache=cache, use_cache=True).logits
        out.append(torch.log_softmax(logits.float(), dim=-1))
        if codec is not None:
            round_trip(cache, layout, codec, a, a + size)
    return torch.cat(out, dim=1)


def compare(reference: torch.Tensor, other: torch.Tensor) -> tuple[int, float, int]:
    """(positions whose argmax agrees, summed KL(reference || other), positions)."""
    agree = int((reference.argmax(-1) == other.argmax(-1)).sum())
    kl = torch.sum(reference.exp() * (reference - other), dim=-1)
    return agree, float(kl.sum()), int(kl.numel())


def measure(
    model: Any,
    layout: KVLayout,
    sequences: torch.Tensor,
    prompt_tokens: int,
    codecs: dict[str, Codec],
    batch: int,
) -> dict[str, Quality]:
    """``Quality`` of each codec against raw over ``sequences`` ``[N, P + C]``."""
    agree = dict.fromkeys(codecs, 0)
    kl = dict.fromkeys(codecs, 0.0)
    positions = dict.fromkeys(codecs, 0)
    for rows in sequences.split(batch):
        reference = continuation_logprobs(model, layout, rows, prompt_tokens, None)
        for name, codec in codecs.items():
            a, k, n = compare(
                reference, continuation_logprobs(model, layout, rows, prompt_tokens, codec)
            )
            agree[name] += a
            kl[name] += k
            positions[name] += n
    return {name: Quality(agree[name] / n, kl[name] / n, n) for name, n in positions.items() if n}


def text_corpus() -> str:
    """Natural English from the standard library's docstrings: the same on every machine
    with this Python, nothing downloaded."""
    import argparse
    import collections
    import email
    import json
    import logging
    import pathlib
    import subprocess
    import threading
    import typing
    import unittest

    parts: list[str] = []
    for module in (argparse, collections, email, json, logging, pathlib, subprocess):
        parts.append(inspect.getdoc(module) or "")
        for _, member in inspect.getmembers(module):
            doc = inspect.getdoc(member) if inspect.isclass(member) or callable(member) else None
            if doc and len(doc) > 200:
                parts.append(doc)
    for module in (threading, typing, unittest):
        parts.append(inspect.getsource(module))
    return "\n\n".join(dict.fromkeys(parts))  # each text once, in order


def text_windows(tokenizer: Any, count: int, tokens: int) -> torch.Tensor:
    """``[count, tokens]`` windows of the tokenised corpus (cycled if it runs short)."""
    ids = tokenizer(text_corpus(), add_special_tokens=False, return_tensors="pt").input_ids[0]
    repeat = math.ceil(count * tokens / ids.numel())
    ids = ids.repeat(repeat)[: count * tokens]
    return ids.view(count, tokens)


def random_windows(vocab_size: int, count: int, tokens: int, seed: int) -> torch.Tensor:
    """``[count, tokens]`` seeded random token ids (the random-weight models)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (count, tokens), generator=gen)


PASS_KEY_QUESTION = "What is the pass key in the text above? Reply with the number only."
PASS_KEY_NEW_TOKENS = 20  # "The pass key in the text is " and 5 digits, a token each, fit


@dataclass(frozen=True)
class PassKey:
    """One codec's answers to the pass-key question, one per document.

    Attributes:
        answers: the generated text per document.
        found: documents whose answer holds their key.
    """

    answers: list[str]
    found: int


@torch.inference_mode()
def pass_key_answers(
    model: Any,
    tokenizer: Any,
    layout: KVLayout,
    codecs: dict[str, Codec],
    context: int,
    documents: int,
) -> dict[str, PassKey]:
    """``PassKey`` of raw and each codec on ``kvtier run``'s pass-key documents (its
    filler, the 5-digit key stated twice at 40 % depth, its question and chat template),
    seeds ``0 .. documents - 1``; every whole chunk of a prompt but the last token's is
    round-tripped through the codec, the same prompts for every codec, greedy answers.

    What the embedded 135M model can do (raw, greedy): it answers "The pass key in the text
    is NNNNN." for all of seeds 0-3 at 2,048 tokens, but at 4,096 for only 2 of them
    (seeds 0 and 3: "123456"). Its answer takes 13 tokens (each digit is one), so fewer
    than 13 new tokens cut the key short; that, and the 4,096-token document of seed 0,
    made every codec "miss" before.
    """
    from kvtier.models import chat_ids
    from kvtier.run import make_document

    found: dict[str, list[bool]] = {name: [] for name in ("raw", *codecs)}
    answers: dict[str, list[str]] = {name: [] for name in found}
    for seed in range(documents):
        document, pass_key = make_document(tokenizer, context, seed)
        content = f"{document}\n\n{PASS_KEY_QUESTION}"
        ids = chat_ids(tokenizer, [{"role": "user", "content": content}])
        sealed = layout.prefix_limit(ids.shape[1])
        prefilled = DynamicCache(config=model.config)
        model(ids[:, :sealed], cache=prefilled, use_cache=True)
        for name, codec in {"raw": None, **codecs}.items():
            cache = copy.deepcopy(prefilled)
            if codec is not None:
                round_trip(cache, layout, codec, 0, sealed)
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), cache=cache,
                max_new_tokens=PASS_KEY_NEW_TOKENS, do_sample=False,
                pad_token_id=tokenizer.eos_token_id,
            )  # fmt: skip
            answer = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True).strip()
            answers[name].append(answer)
            found[name].append(pass_key in answer)
    return {name: PassKey(answers[name], sum(found[name])) for name in found}
