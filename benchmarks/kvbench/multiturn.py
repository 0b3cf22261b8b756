"""Benchmark ``multiturn``: next-round time to first token for interleaved chat users.

Question: when several users chat in turns and each user's KV leaves the device while the
others are served, how much sooner does a user's next round start because kvtier reuses
the conversation's KV from its host tier, against recomputing the whole conversation?

Method: ``--users`` (4; quick 2) users, ``--rounds`` (4; quick 3) rounds each, interleaved
(user 0 round 1, user 1 round 1, …, user 0 round 2, …), one request at a time. Round 1 is a
user's opening, ``--first-tokens`` (2048; quick 512) seeded random token ids; round r's
prompt is round r − 1's prompt + the answer it got + a new message of ``--message-tokens``
(uniform in [32, 96]: a chat follow-up) seeded random ids. The new tokens must be computed
either way, so the speedup is bounded by about (history + new) ÷ new: longer messages
lower it (``--message-tokens 300 600`` is the long-message case in docs/benchmarks.md).
Greedy, 16 new tokens, end of sequence ignored. TTFT is submit → first token event
(in-process, no HTTP).

- kvtier: one ``Engine`` for the whole run (continuous batching, ``max_batch_size`` 4),
  64-token chunks, prefill in forwards of up to 1024 tokens, ``--device-budget-mb`` (32 MiB,
  about 700 tokens of the embedded model's KV, below every prompt) per sequence, a 1 GiB host
  tier. A finished sequence's device tier is emptied for the next one, so a returning user's
  KV comes back from the host tier; the reused tokens are reported by tier to show it.
- recompute (same run, right after each kvtier request, on the same prompt): a fresh
  ``Engine`` with empty tiers on a second copy of the weights, the same chunking and
  prefill forwards, and a device budget that holds the whole prompt (all resident, nothing
  streamed), so it reuses nothing and pays no offload cost: the stronger baseline.

Each answer must equal the recompute's token for token. Summary: ``ttft_speedup_round2``,
the median over users and rounds ≥ 2 of recompute TTFT ÷ kvtier TTFT, and medians by round.
"""

from __future__ import annotations

import random
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from kvbench.common import base_parser, finish, header, median
from kvbench.setup import engine_config
from kvtier.config import MiB
from kvtier.engine import Engine, EngineConfig, SamplingParams
from kvtier.kv import KVLayout
from kvtier.models import LoadedModel, load_model

NEW_TOKENS = 16
CHUNK_TOKENS = 64
PREFILL_TOKENS_PER_STEP = 1024
MAX_BATCH_SIZE = 4
FIRST_TOKEN_ID = 100  # random ids start above the special and byte tokens


@dataclass
class Turn:
    """One user's round, served by kvtier and recomputed.

    Attributes:
        user: the user (0-based).
        round: the round (1-based).
        prompt_tokens: the prompt's length.
        kvtier_ttft_s: submit → first token on kvtier's engine.
        recompute_ttft_s: the same on a fresh engine with empty tiers.
        reused_tokens: prompt tokens kvtier adopted from its tiers.
        reused_tokens_by_tier: the same, by the tier that held each chunk.
        tokens: kvtier's answer.
        same_tokens: whether the recompute answered with exactly the same tokens.
    """

    user: int
    round: int
    prompt_tokens: int
    kvtier_ttft_s: float
    recompute_ttft_s: float
    reused_tokens: int
    reused_tokens_by_tier: dict[str, int] = field(default_factory=dict)
    tokens: list[int] = field(default_factory=list)
    same_tokens: bool = False

    @property
    def speedup(self) -> float:
        """Recompute TTFT ÷ kvtier TTFT."""
        return self.recompute_ttft_s / self.kvtier_ttft_s


def message_ids(
    seed: int, user: int, round_: int, tokens: tuple[int, int], vocab_size: int
) -> list[int]:
    """A user's message of a round: seeded random ids, length uniform in ``tokens``
    (inclusive); the same for the same (seed, user, round) whatever the order of calls."""
    rng = random.Random(f"{seed}:{user}:{round_}")
    return [rng.randrange(FIRST_TOKEN_ID, vocab_size) for _ in range(rng.randint(*tokens))]


def first_token(engine: Engine, prompt: list[int]) -> tuple[float, list[int], int]:
    """Submit greedily; (seconds to the first token, every token, reused prompt tokens)."""
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    start = time.perf_counter()
    handle = engine.submit(prompt, params)
    ttft_s: float | None = None
    tokens: list[int] = []
    for event in handle:
        if event.token_id is not None:
            if ttft_s is None:
                ttft_s = time.perf_counter() - start
            tokens.append(event.token_id)
    if ttft_s is None:
        raise RuntimeError("multiturn: the engine ended a request without a token")
    return ttft_s, tokens, handle.reused_tokens


def kvtier_config(device_budget_mb: int, host_mb: int) -> EngineConfig:
    """The engine under test: a small per-sequence device budget, a host tier for all users."""
    return engine_config(
        MAX_BATCH_SIZE,
        device_budget_mb * MiB,
        host_mb * MiB,
        CHUNK_TOKENS,
        prefill_tokens_per_step=PREFILL_TOKENS_PER_STEP,
    )


def recompute_config(layout: KVLayout, prompt_tokens: int) -> EngineConfig:
    """A one-request engine whose device budget and host tier hold the whole sequence.

    One sequence at a time (``max_batch_size`` 1): it serves a single request, and a larger
    batch would only reserve more device caches at start.
    """
    chunks = -(-(prompt_tokens + NEW_TOKENS) // CHUNK_TOKENS) + 2  # + tail and one spare
    nbytes = chunks * layout.chunk_nbytes
    return engine_config(
        1, nbytes, nbytes, CHUNK_TOKENS, prefill_tokens_per_step=PREFILL_TOKENS_PER_STEP
    )


def recompute(
    baseline: LoadedModel, layout: KVLayout, prompt: list[int]
) -> tuple[float, list[int]]:
    """TTFT and tokens of ``prompt`` on a fresh engine (empty tiers: nothing to reuse)."""
    config = recompute_config(layout, len(prompt))
    with Engine(baseline.model, baseline.tokenizer, config, model_id=baseline.model_id) as engine:
        ttft_s, tokens, reused = first_token(engine, prompt)
    if reused:
        raise RuntimeError(f"multiturn: the recompute engine reused {reused} tokens")
    return ttft_s, tokens


def by_round(turns: list[Turn]) -> dict[str, dict[str, float]]:
    """Medians over users, per round: prompt length, reused tokens, both TTFTs, speedup."""
    rounds: dict[str, dict[str, float]] = {}
    for r in sorted({t.round for t in turns}):
        group = [t for t in turns if t.round == r]
        rounds[str(r)] = {
            "prompt_tokens": median([float(t.prompt_tokens) for t in group]),
            "reused_tokens": median([float(t.reused_tokens) for t in group]),
            "kvtier_ttft_s": median([t.kvtier_ttft_s for t in group]),
            "recompute_ttft_s": median([t.recompute_ttft_s for t in group]),
            "speedup": median([t.speedup for t in group]),
        }
    return rounds


def summarize(turns: list[Turn], device_budget_nbytes: int, token_nbytes: int) -> dict[str, Any]:
    """The summary: ``ttft_speedup_round2`` (median of recompute ÷ kvtier TTFT over users
    and rounds ≥ 2), medians by round, where rounds ≥ 2 reused from, and the checks."""
    later = [t for t in turns if t.round >= 2]
    tiers: dict[str, int] = {}
    for turn in later:
        for tier, tokens in turn.reused_tokens_by_tier.items():
            tiers[tier] = tiers.get(tier, 0) + tokens
    rounds = by_round(turns)
    smallest_kv = min((t.prompt_tokens * token_nbytes for t in later), default=0)
    return {
        "ttft_speedup_round2": median([t.speedup for t in later]) if later else None,
        "ttft_speedup_by_round": {r: v["speedup"] for r, v in rounds.items()},
        "kvtier_ttft_s_by_round": {r: v["kvtier_ttft_s"] for r, v in rounds.items()},
        "recompute_ttft_s_by_round": {r: v["recompute_ttft_s"] for r, v in rounds.items()},
        "reused_tokens_by_tier_round2": tiers,
        "reused_fraction_round2": (
            sum(t.reused_tokens for t in later) / sum(t.prompt_tokens for t in later)
            if later
            else None
        ),
        "every_later_round_reused": all(t.reused_tokens > 0 for t in later),
        # The device could not have kept a prompt: each exceeds the per-sequence budget, and
        # no reused chunk was found on a device tier.
        "kv_left_device": smallest_kv > device_budget_nbytes and not tiers.get("device", 0),
        "tokens_identical": all(t.same_tokens for t in turns),
    }


def run(
    ours: LoadedModel,
    baseline: LoadedModel,
    users: int,
    rounds: int,
    first_tokens: int,
    message_tokens: tuple[int, int],
    device_budget_mb: int,
    host_mb: int,
    seed: int,
) -> list[Turn]:
    """Every user's every round, interleaved; kvtier then recompute for each."""
    model = ours.model
    vocab = int(model.get_input_embeddings().num_embeddings)
    dtype = next(model.parameters()).dtype
    layout = KVLayout.from_model_config(model.config, dtype, CHUNK_TOKENS)
    prompts: list[list[int]] = [[] for _ in range(users)]
    answers: list[list[int]] = [[] for _ in range(users)]
    turns: list[Turn] = []
    config = kvtier_config(device_budget_mb, host_mb)
    with Engine(model, ours.tokenizer, config, model_id=ours.model_id) as engine:
        warm = message_ids(seed - 1, -1, 0, (300, 300), vocab)  # not any user's ids
        first_token(engine, warm)
        recompute(baseline, layout, warm)
        for r in range(1, rounds + 1):
            for u in range(users):
                if r == 1:
                    opening = message_ids(seed, u, 0, (first_tokens, first_tokens), vocab)
                    prompts[u] = opening
                else:
                    new = message_ids(seed, u, r, message_tokens, vocab)
                    prompts[u] = prompts[u] + answers[u] + new
                prompt = prompts[u]
                before = engine.stats().reused_tokens_by_tier
                kv_s, tokens, reused = first_token(engine, prompt)
                after = engine.stats().reused_tokens_by_tier
                re_s, re_tokens = recompute(baseline, layout, prompt)
                by_tier = {
                    k: v - before.get(k, 0) for k, v in after.items() if v > before.get(k, 0)
                }
                turn = Turn(
                    u, r, len(prompt), kv_s, re_s, reused, by_tier, tokens, tokens == re_tokens
                )
                turns.append(turn)
                answers[u] = tokens
                print(
                    f"  user {u} round {r}: {len(prompt)} tokens, reused {reused} {by_tier}, "
                    f"kvtier {kv_s:.2f} s, recompute {re_s:.2f} s ({turn.speedup:.1f}x)"
                    f"{'' if turn.same_tokens else ', TOKENS DIFFER'}",
                    flush=True,
                )
    return turns


def print_table(rounds: dict[str, dict[str, float]]) -> None:
    print(
        f"{'round':>5}{'prompt tok':>11}{'reused':>8}{'kvtier TTFT s':>14}"
        f"{'recompute s':>12}{'speedup':>9}"
    )
    for r, v in rounds.items():
        print(
            f"{r:>5}{v['prompt_tokens']:>11.0f}{v['reused_tokens']:>8.0f}"
            f"{v['kvtier_ttft_s']:>14.2f}{v['recompute_ttft_s']:>12.2f}{v['speedup']:>8.1f}x"
        )


def main(argv: list[str] | None = None) -> int:
    parser = base_parser("multiturn", __doc__)
    add = parser.add_argument
    parser.sized("--users", 4, 2, "users", type=int, minimum=1)
    parser.sized("--rounds", 4, 3, "rounds per user", type=int, minimum=1)
    parser.sized("--first-tokens", 2048, 512, "round 1 prompt", type=int, minimum=1)
    add(
        "--message-tokens",
        type=int,
        nargs=2,
        default=(32, 96),
        metavar=("LO", "HI"),
        help="new user message per round (uniform in [LO, HI]; default 32 96)",
    )
    add(
        "--device-budget-mb",
        type=int,
        default=32,
        minimum=1,
        help="kvtier's device budget per sequence",
    )
    add("--host-mb", type=int, default=1024, minimum=1, help="kvtier's host tier")
    add("--model", default=None, help="HF model folder or .gguf (default: embedded)")
    add("--threads", type=int, default=1, minimum=1, help="torch threads")
    args = parser.parse(argv)
    users, rounds, first_tokens = args.users, args.rounds, args.first_tokens
    lo, hi = args.message_tokens
    if not 1 <= lo <= hi:
        raise ValueError(f"--message-tokens: need 1 <= LO <= HI, got {lo} {hi}")
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    info = header()
    ours = load_model(args.model)
    baseline = load_model(args.model)  # a second copy of the weights for the recompute
    longest = first_tokens + (rounds - 1) * (NEW_TOKENS + hi) + NEW_TOKENS
    limit = int(ours.model.config.get_text_config().max_position_embeddings)
    if longest > limit:
        raise ValueError(
            f"--rounds/--first-tokens/--message-tokens: the last round reaches {longest} tokens, "
            f"beyond the model's context of {limit}"
        )
    print(
        f"model: {ours.model_id}; {users} users x {rounds} rounds, opening {first_tokens} "
        f"tokens, messages {lo}-{hi} tokens, {NEW_TOKENS} new tokens; kvtier device budget "
        f"{args.device_budget_mb} MiB a sequence, host {args.host_mb} MiB"
    )
    turns = run(
        ours,
        baseline,
        users,
        rounds,
        first_tokens,
        (lo, hi),
        args.device_budget_mb,
        args.host_mb,
        args.seed,
    )
    layout = KVLayout.from_model_config(ours.model.config, torch.float32, CHUNK_TOKENS)
    token_nbytes = layout.chunk_nbytes // CHUNK_TOKENS
    summary = summarize(turns, args.device_budget_mb * MiB, token_nbytes)
    rounds_table = by_round(turns)
    print_table(rounds_table)
    result = {
        "summary": summary,
        "cases": {"turns": [{**asdict(t), "speedup": t.speedup} for t in turns]},
        "by_round": rounds_table,
        "config": {
            "quick": args.quick,
            "seed": args.seed,
            "model": ours.model_id,
            "dtype": "float32",
            "users": users,
            "rounds": rounds,
            "first_tokens": first_tokens,
            "message_tokens": [lo, hi],
            "new_tokens": NEW_TOKENS,
            "chunk_tokens": CHUNK_TOKENS,
            "prefill_tokens_per_step": PREFILL_TOKENS_PER_STEP,
            "max_batch_size": MAX_BATCH_SIZE,
            "device_budget_mb": args.device_budget_mb,
            "host_mb": args.host_mb,
            "kv_token_nbytes": token_nbytes,
            "recompute": (
                "a fresh Engine per request on a second copy of the weights: empty tiers, "
                "a device budget holding the whole prompt, same chunks and prefill forwards"
            ),
            "threads": args.threads,
        },
    }
    speedup = summary["ttft_speedup_round2"]
    finish(
        args.json,
        result,
        info,
        f"summary: ttft_speedup_round2 {speedup:.1f}x (median recompute ÷ kvtier TTFT over "
        f"rounds >= 2); reused from {summary['reused_tokens_by_tier_round2']}; tokens identical "
        f"{summary['tokens_identical']}",
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
