"""Benchmark ``throughput``: offline generation tokens/s, continuous batching vs static.

Question: for a batch of requests with mixed prompt lengths, how many tokens per second does
kvtier's engine (``LLM.generate`` with continuous batching) produce, against transformers
``model.generate`` with static batching, measured in the same run on the same model?

Method, per request count N (16 and 64; ``--quick``: 8): N prompts of seeded random token
ids with lengths uniform in [64, 1024] (``--quick``: [64, 512]), 32 new tokens each, greedy,
end-of-sequence ignored, so every request generates exactly 32 tokens.

- ``hf_static``: the prompts in submission order, in batches of 16, left-padded, through
  ``model.generate`` (``DynamicCache``, SDPA attention); a batch ends when its last row does.
- ``hf_continuous``: transformers' own continuous batching (``model.generate_batch``,
  paged KV cache) over all N at once, on the same weights as ``hf_static``; its manager is
  built and warmed first on N prompts of the same lengths but other ids
  (``persistent_manager``), so the timed call measures generation, not cache allocation.
- ``kvtier``: ``LLM.generate`` over all N at once on a second copy of the weights; the
  engine admits up to 16 sequences and runs one forward per step that packs prefill pieces
  (whole chunks, no padding) with the next token of every decoding sequence.

Each system runs ``--repeats`` times (default 2), interleaved, kvtier on a fresh engine
each time; the figures are medians (every run is in the JSON). Figures: generated tokens /
wall seconds for each, the ratios (``speedup_vs_hf_static_N``,
``speedup_vs_hf_continuous_N``), and how many requests got exactly the same tokens as
``hf_static``.
"""

from __future__ import annotations

import random
import time
from typing import Any

import torch
from transformers import DynamicCache

from kvbench.common import base_parser, finish, header, median
from kvbench.setup import engine_config as sized_engine
from kvtier.config import MiB
from kvtier.engine import LLM, EngineConfig, SamplingParams
from kvtier.models import load_model

NEW_TOKENS = 32
STATIC_BATCH = 16
CHUNK_TOKENS = 256
PREFILL_TOKENS_PER_STEP = 4096  # offline: throughput over inter-token latency


def make_prompts(count: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    """``count`` prompts of random ids (no special tokens), lengths uniform in [lo, hi]."""
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(count)]


def padded_tokens(prompts: list[list[int]]) -> int:
    """Prompt tokens static batching computes: every row padded to its batch's longest."""
    batches = [prompts[i : i + STATIC_BATCH] for i in range(0, len(prompts), STATIC_BATCH)]
    return sum(len(b) * max(len(p) for p in b) for b in batches)


@torch.no_grad()
def hf_static(model: Any, prompts: list[list[int]], pad_id: int) -> tuple[float, list[list[int]]]:
    """Seconds for transformers ``generate`` over left-padded batches; and the tokens."""
    outputs: list[list[int]] = []
    start = time.perf_counter()
    for i in range(0, len(prompts), STATIC_BATCH):
        batch = prompts[i : i + STATIC_BATCH]
        width = max(len(p) for p in batch)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in batch])  # [B, S]
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        out = model.generate(
            ids,
            attention_mask=mask,
            cache=DynamicCache(config=model.config),
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
            pad_token_id=pad_id,
        )
        outputs.extend(out[:, width:].tolist())
    return time.perf_counter() - start, outputs


@torch.no_grad()
def hf_continuous(model: Any, prompts: list[list[int]]) -> tuple[float, list[list[int]]]:
    """Seconds for transformers ``generate_batch`` (continuous batching); and the tokens.

    The manager is created and warmed first on prompts of the same lengths but other ids
    (it sizes its paged cache for the workload it first sees, and shares blocks of equal
    prefixes) and kept (``persistent_manager``), so the timed call pays neither for the
    cache allocation nor gets the prompts' KV for free.
    """
    from transformers import GenerationConfig

    config = GenerationConfig(
        max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=-1, pad_token_id=0
    )
    others = [[100 + (7 * t + 13) % 30000 for t in p] for p in prompts]
    model.generate_batch(inputs=others, generation_config=config, persistent_manager=True)
    start = time.perf_counter()
    out = model.generate_batch(
        inputs=prompts, generation_config=config, persistent_manager=True, warmup=False
    )
    seconds = time.perf_counter() - start
    model.destroy_cached_continuous_batching_manager()
    by_prompt = sorted(out.values(), key=lambda o: int(o.request_id.rsplit("_", 1)[-1]))
    errors = [o.error for o in by_prompt if o.error]
    if errors:
        raise RuntimeError(f"transformers continuous batching failed: {errors[0]}")
    return seconds, [list(o.generated_tokens) for o in by_prompt]


def kvtier_engine(llm: LLM, prompts: list[list[int]]) -> tuple[float, list[list[int]], Any]:
    """Seconds for ``LLM.generate`` over all prompts; the tokens; the engine's stats."""
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    return seconds, [o.token_ids for o in outs], llm.engine.stats()


def engine_config(layout_token_nbytes: int, longest: int, count: int) -> EngineConfig:
    """Room on the device for each sequence's whole KV; a host tier for every request."""
    per_sequence = layout_token_nbytes * (longest + NEW_TOKENS + 2 * CHUNK_TOKENS)
    host = max(256 * MiB, layout_token_nbytes * (longest + NEW_TOKENS) * count)
    return sized_engine(
        STATIC_BATCH,
        per_sequence,
        host,
        CHUNK_TOKENS,
        max_queued=max(64, count),
        prefill_tokens_per_step=PREFILL_TOKENS_PER_STEP,
    )


def run(quick: bool, seed: int, counts: tuple[int, ...], repeats: int = 1) -> dict[str, Any]:
    lo, hi = (64, 512) if quick else (64, 1024)
    baseline = load_model()
    ours = load_model()
    model = baseline.model.eval()
    vocab = int(model.get_input_embeddings().num_embeddings)
    pad_id = baseline.tokenizer.pad_token_id
    pad_id = 0 if pad_id is None else int(pad_id)
    text = model.config.get_text_config()
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    token_nbytes = 2 * text.num_hidden_layers * text.num_key_value_heads * head_dim * 4
    cases: dict[str, dict[str, Any]] = {}
    summary: dict[str, float] = {}
    for n in counts:
        prompts = make_prompts(n, lo, hi, vocab, seed + n)
        config = engine_config(token_nbytes, hi, n)
        kv_runs: list[float] = []
        hf_runs: list[float] = []
        cb_runs: list[float] = []
        cb_error: str | None = None
        cb_tokens: list[list[int]] = []
        for _ in range(repeats):  # interleaved: machine noise hits every system alike
            started = time.perf_counter()
            # A fresh engine each time: its tiers must not hold the prompts' KV already.
            with LLM(ours.model, tokenizer=ours.tokenizer, config=config) as llm:
                start_s = time.perf_counter() - started
                kvtier_engine(llm, make_prompts(2, 8, 40, vocab, seed - 1))  # warm the paths
                kv_s, kv_tokens, stats = kvtier_engine(llm, prompts)
            kv_runs.append(kv_s)
            hf_s, hf_tokens = hf_static(model, prompts, pad_id)
            hf_runs.append(hf_s)
            if cb_error is None:
                try:
                    cb_s, cb_tokens = hf_continuous(model, prompts)
                    cb_runs.append(cb_s)
                except Exception as exc:  # a baseline that cannot run here is reported
                    cb_error = f"{type(exc).__name__}: {exc}"
        kv_s, hf_s = median(kv_runs), median(hf_runs)
        cb_s = median(cb_runs)
        generated = n * NEW_TOKENS
        same = sum(a == b for a, b in zip(kv_tokens, hf_tokens, strict=True))
        same_cb = sum(a == b for a, b in zip(cb_tokens, hf_tokens, strict=False))
        case = {
            "requests": n,
            "prompt_tokens": sum(len(p) for p in prompts),
            "padded_prompt_tokens": padded_tokens(prompts),
            "generated_tokens": generated,
            "kvtier_s": round(kv_s, 3),
            "hf_static_s": round(hf_s, 3),
            "kvtier_s_runs": [round(x, 3) for x in kv_runs],
            "hf_static_s_runs": [round(x, 3) for x in hf_runs],
            "hf_continuous_s_runs": [round(x, 3) for x in cb_runs],
            "kvtier_tokens_per_s": round(generated / kv_s, 2),
            "hf_static_tokens_per_s": round(generated / hf_s, 2),
            "hf_continuous_s": round(cb_s, 3),
            "hf_continuous_tokens_per_s": round(generated / cb_s, 2),
            "hf_continuous_error": cb_error,
            "same_tokens_requests": same,
            "hf_continuous_same_tokens_requests": same_cb,
            "kvtier_engine_start_s": round(start_s, 3),
            "mean_decode_batch": round(stats.mean_decode_batch, 2),
            "max_decode_batch": stats.max_decode_batch,
            "decode_steps": stats.decode_steps,
        }
        cases[str(n)] = case
        summary[f"speedup_vs_hf_static_{n}"] = round(hf_s / kv_s, 3)
        if cb_error is None:
            summary[f"speedup_vs_hf_continuous_{n}"] = round(cb_s / kv_s, 3)
        summary[f"kvtier_tokens_per_s_{n}"] = case["kvtier_tokens_per_s"]
        summary[f"hf_static_tokens_per_s_{n}"] = case["hf_static_tokens_per_s"]
    return {
        "summary": summary,
        "cases": cases,
        "config": {
            "quick": quick,
            "seed": seed,
            "repeats": repeats,
            "prompt_tokens_range": [lo, hi],
            "new_tokens": NEW_TOKENS,
            "static_batch": STATIC_BATCH,
            "max_batch_size": STATIC_BATCH,
            "chunk_tokens": CHUNK_TOKENS,
            "prefill_tokens_per_step": PREFILL_TOKENS_PER_STEP,
            "model": ours.model_id,
            "dtype": "float32",
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = base_parser("throughput", __doc__)
    parser.sized("--requests", [16, 64], [8], "request counts", type=int, nargs="+")
    parser.sized("--repeats", 2, 1, "interleaved runs of each system", type=int, minimum=1)
    args = parser.parse(argv)
    info = header()
    result = run(args.quick, args.seed, tuple(args.requests), args.repeats)
    print(
        f"{'requests':>9}{'prompt tok':>11}{'padded':>9}{'kvtier tok/s':>14}{'hf static':>11}"
        f"{'hf cont.':>10}{'vs static':>11}{'vs cont.':>10}{'same':>6}{'batch':>7}"
    )
    for case in result["cases"].values():
        n = case["requests"]
        summary = result["summary"]
        print(
            f"{n:>9}{case['prompt_tokens']:>11}{case['padded_prompt_tokens']:>9}"
            f"{case['kvtier_tokens_per_s']:>14.1f}{case['hf_static_tokens_per_s']:>11.1f}"
            f"{case['hf_continuous_tokens_per_s']:>10.1f}"
            f"{summary[f'speedup_vs_hf_static_{n}']:>11.2f}"
            f"{summary.get(f'speedup_vs_hf_continuous_{n}', float('nan')):>10.2f}"
            f"{case['same_tokens_requests']:>6}{case['mean_decode_batch']:>7.1f}"
        )
        if case["hf_continuous_error"]:
            print(f"  transformers continuous batching did not run: {case['hf_continuous_error']}")
    s = result["summary"]
    speedups = ", ".join(f"{k} {v}" for k, v in sorted(s.items()) if "speedup" in k)
    finish(args.json, result, info, f"summary: {speedups}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
