"""``kvtier run``: the main job — a long document on a small device budget, two turns.

Turn 1 asks the embedded model for a pass key hidden in a deterministic ~6K-token document,
with the device budget at 25 % of the final KV; the same question is answered by
transformers' all-resident ``DynamicCache`` in the same run, and the tokens are compared.
Turn 2 asks a follow-up with a fresh device tier, so the first turn's KV must come back from
the host (or disk) tier; its time to first token is set against recomputing the prompt.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvtier.config import (
    CODEC_HELP,
    CODEC_NAMES,
    PLACEMENTS,
    DiskConfig,
    HostConfig,
    LinkConfig,
    ManagerConfig,
    TieredCacheConfig,
)
from kvtier.hf import TieredCache
from kvtier.hf.generate import GenerateResult, generate, generate_resident
from kvtier.kv import KVLayout
from kvtier.machine import machine_info
from kvtier.manager import KVManager
from kvtier.models import chat_ids, load_model
from kvtier.policy import EVICTION_POLICIES

FILLER = [
    "The grass is green and the sky is blue.",
    "The sun is warm and the river runs to the sea.",
    "A farmer walks along the road with his dog.",
    "Clouds drift slowly over the quiet hills.",
    "The market opens early and closes late.",
    "Birds sing in the old oak tree by the mill.",
]


@dataclass(frozen=True)
class Turn:
    """One measured generation."""

    text: str
    tokens: list[int]
    ttft_s: float
    decode_tokens_per_s: float
    reused_tokens: int = 0


def make_document(tokenizer: Any, context_tokens: int, seed: int) -> tuple[str, str]:
    """A filler document of about ``context_tokens`` tokens with a pass key at 40 % depth."""
    rng = random.Random(seed)
    pass_key = str(rng.randint(10_000, 99_999))
    needle = f"The pass key is {pass_key}. Remember it. {pass_key} is the pass key."
    sentences: list[str] = []
    budget = context_tokens - 80  # room for the chat template and the question
    tokens = 0
    while tokens < budget:
        sentence = rng.choice(FILLER)
        sentences.append(sentence)
        tokens += len(tokenizer.encode(" " + sentence, add_special_tokens=False))
    sentences.insert(int(len(sentences) * 0.4), needle)
    return " ".join(sentences), pass_key


def run_baseline(model: Any, ids: torch.Tensor, max_new_tokens: int, tokenizer: Any) -> Turn:
    """The same question through transformers' all-resident ``DynamicCache``."""
    result = generate_resident(model, ids, max_new_tokens=max_new_tokens, do_sample=False)
    return as_turn(result, ids, tokenizer)


def as_turn(result: GenerateResult, ids: torch.Tensor, tokenizer: Any) -> Turn:
    new = result.sequences[0, ids.shape[1] :].tolist()
    return Turn(
        tokenizer.decode(new, skip_special_tokens=True),
        new,
        result.ttft_s,
        result.decode_tokens_per_s,
        result.reused_tokens,
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kvtier run", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="HF model folder (default: embedded)")
    parser.add_argument("--context", type=int, default=6000, help="document tokens")
    parser.add_argument("--budget", type=float, default=0.25, help="device budget, share of KV")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--link-gbps", type=float, default=None, help="throttle host->device")
    parser.add_argument("--link-latency-ms", type=float, default=0.0)
    parser.add_argument("--disk-dir", default=None, help="also keep chunks on disk here")
    for tier in ("host", "disk"):
        parser.add_argument(
            f"--{tier}-codec",
            choices=CODEC_NAMES,
            default="raw",
            help=f"the {tier} tier's chunk format: {CODEC_HELP}",
        )
    parser.add_argument(
        "--eviction-policy",
        choices=sorted(EVICTION_POLICIES),
        default="lru",
        help="which chunk host and disk evict first (as kvtier serve's flag)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads (CPU default 1: compute on one core, the link's copies on another)",
    )
    parser.add_argument(
        "--placement",
        choices=PLACEMENTS,
        default="stream",
        help="non-resident KV: stream it, attend it on the host, or auto (the cost model)",
    )
    parser.add_argument("--json", type=Path, default=None, help="write every figure here")
    args = parser.parse_args(argv)
    if args.threads is not None and args.threads < 1:
        parser.error(f"--threads: must be >= 1, got {args.threads}")
    if not 0 < args.budget <= 1:
        parser.error(f"--budget: must be in (0, 1], got {args.budget}")
    if args.context < 512:
        parser.error(f"--context: must be >= 512 tokens, got {args.context}")
    if args.placement == "host" and args.host_codec != "raw":  # before the model loads
        parser.error(f"--placement host reads the host tier in place: needs --host-codec raw, "
                     f"got {args.host_codec}")  # fmt: skip
    return args


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    if args.threads is not None or not torch.cuda.is_available():
        # On a CPU-only machine the "device" and the link share the cores; one compute thread
        # leaves a core to the copy thread (the role of a GPU's copy engine), and the same
        # setting applies to the baseline measured beside it.
        torch.set_num_threads(args.threads or 1)
    say("loading the model…")
    loaded = load_model(args.model)
    model, tokenizer = loaded.model, loaded.tokenizer
    document, pass_key = make_document(tokenizer, args.context, args.seed)
    question = "What is the pass key in the text above? Reply with the number only."
    messages = [{"role": "user", "content": f"{document}\n\n{question}"}]
    ids = chat_ids(tokenizer, messages)
    layout = KVLayout.from_model_config(model.config, torch.float32, 256)
    final_tokens = ids.shape[1] + args.max_new_tokens
    budget_bytes = max(int(args.budget * layout.kv_nbytes(final_tokens)), layout.chunk_nbytes)
    link = LinkConfig(gbps=args.link_gbps, latency_ms=args.link_latency_ms)
    cache_config = TieredCacheConfig(
        device_budget_bytes=budget_bytes, link=link, placement=args.placement
    )
    manager = KVManager(
        layout,
        loaded.model_id,
        ManagerConfig(
            host=HostConfig(
                capacity_bytes=layout.kv_nbytes(2 * final_tokens + 1024),
                eviction_policy=args.eviction_policy,
                codec=args.host_codec,
            ),
            lower_tiers=(
                DiskConfig(
                    path=args.disk_dir, codec=args.disk_codec, eviction_policy=args.eviction_policy
                ),
            )
            if args.disk_dir is not None
            else (),
        ),
    )
    say(
        f"prompt: {ids.shape[1]} tokens, KV {layout.kv_nbytes(final_tokens) / 1e6:.0f} MB; "
        f"device budget {budget_bytes / 1e6:.0f} MB ({args.budget:.0%})"
    )
    for tier, codec in (("host", args.host_codec), ("disk", args.disk_codec)):
        if tier == "host" or args.disk_dir is not None:
            exact = "exact" if codec == "raw" else "lossy: tokens may differ"
            say(f"{tier} tier: chunks stored as {codec} ({exact})")
    say("turn 1, baseline: all-resident transformers DynamicCache (one prefill call)…")
    baseline = run_baseline(model, ids, args.max_new_tokens, tokenizer)
    say("turn 1, kvtier: TieredCache…")
    cache = TieredCache(model, cache_config, manager)
    result = generate(
        model, cache, ids, progress=True, max_new_tokens=args.max_new_tokens, do_sample=False
    )
    first = as_turn(result, ids, tokenizer)
    first_stats = cache.stats()
    link_desc = first_stats.link_description
    cache.close()

    # Turn 2: a follow-up on the same document with a fresh device tier.
    follow = [
        *messages,
        {"role": "assistant", "content": first.text},
        {"role": "user", "content": "Say the pass key once more, digits only."},
    ]
    ids2 = chat_ids(tokenizer, follow)
    say("turn 2, recompute: DynamicCache prefill of the whole conversation…")
    recompute = run_baseline(model, ids2, args.max_new_tokens, tokenizer)
    say("turn 2, kvtier: reuse the first turn's KV from the lower tiers…")
    cache2 = TieredCache(model, cache_config, manager)
    second = as_turn(
        generate(model, cache2, ids2, max_new_tokens=args.max_new_tokens, do_sample=False),
        ids2,
        tokenizer,
    )
    second_stats = cache2.stats()
    cache2.close()
    manager_stats = manager.stats()
    manager.close()

    identical = first.tokens == baseline.tokens and second.tokens == recompute.tokens
    summary = {
        "tokens_identical": identical,
        "answer_correct": pass_key in first.text,
        "ttft_s": first.ttft_s,
        "decode_tokens_per_s": first.decode_tokens_per_s,
        "baseline_ttft_s": baseline.ttft_s,
        "baseline_decode_tokens_per_s": baseline.decode_tokens_per_s,
        "stall_s": first_stats.link.wait_s,
        "second_turn_ttft_s": second.ttft_s,
        "second_turn_recompute_ttft_s": recompute.ttft_s,
        "second_turn_ttft_speedup": recompute.ttft_s / second.ttft_s,
        "second_turn_reused_tokens": second.reused_tokens,
        "eviction_policy": args.eviction_policy,
        "codecs": {"host": args.host_codec, "disk": args.disk_codec},
    }
    print(f"\nmachine: {machine_info()['cpu']}; link host->device: {link_desc}")
    print(f"pass key {pass_key}; kvtier answered {first.text!r}; baseline {baseline.text!r}")
    print(f"{'turn 1':<28}{'TTFT s':>10}{'decode tok/s':>14}")
    rows = [("DynamicCache (all resident)", baseline), (f"kvtier, budget {args.budget:.0%}", first)]
    for label, turn in rows:
        print(f"{label:<28}{turn.ttft_s:>10.2f}{turn.decode_tokens_per_s:>14.2f}")
    print("\nturn 1, what moved where:")
    print(first_stats.table())
    print(
        f"\nturn 2: TTFT {second.ttft_s:.2f} s reusing {second.reused_tokens} tokens vs "
        f"{recompute.ttft_s:.2f} s recomputing ({summary['second_turn_ttft_speedup']:.1f}x); "
        f"answer {second.text!r}"
    )
    print(second_stats.table())
    print("\nmanager tiers over both turns:")
    print(manager_stats.table())
    verdict = "identical" if identical else "DIFFERENT"
    lossy = [
        c for c in (args.host_codec, args.disk_codec if args.disk_dir else "raw") if c != "raw"
    ]
    if lossy:
        verdict += f" (chunks stored as {'/'.join(lossy)}, a lossy codec)"
    print(
        f"\ntokens {verdict} to transformers DynamicCache in both turns; answer "
        f"{'correct' if summary['answer_correct'] else 'wrong'}; turn-2 TTFT "
        f"{summary['second_turn_ttft_speedup']:.1f}x faster than recompute"
    )
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        payload = {
            "summary": summary,
            "machine": machine_info({"host->device": link_desc}),
            "config": vars(args) | {"json": str(args.json), "budget_bytes": budget_bytes},
            "turns": {
                "kvtier_1": first.__dict__,
                "baseline_1": baseline.__dict__,
                "kvtier_2": second.__dict__,
                "recompute_2": recompute.__dict__,
            },
        }
        args.json.write_text(json.dumps(payload, indent=2, default=str) + "\n")
        print(f"wrote {args.json}")
    return 0 if identical else 1
