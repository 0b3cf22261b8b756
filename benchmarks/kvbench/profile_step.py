"""Benchmark ``profile_step``: where does one step of kvtier's engine spend its time?

Runs the embedded model in ``kvtier.engine.LLM`` (the peers benchmark's memory split; with
``--bf16``, its bf16 weights, as ``peers --bf16``) on
``--prompts`` seeded prompts of ``--prompt-tokens`` and profiles, with ``torch.profiler``,
one step of the kind asked for: ``decode`` (the ``--skip``-th step whose every piece is one
decoding token and which holds ``--prompts`` sequences) or ``prefill`` (the ``--skip``-th
step that carries a prompt piece). Every step of the run is also timed around the runner
(wall ms), so the profiled step can be compared with its unprofiled neighbours. Prints the
operators by self time and the step's wall time; ``--json`` keeps both.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from kvbench.common import base_parser, finish, header, median
from kvbench.peers import kvtier_engine_config, random_ids
from kvtier.engine import LLM, SamplingParams
from kvtier.engine import runner as runner_module


def run(args: Any) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    steps: list[dict[str, Any]] = []
    profiled: dict[str, Any] = {}
    original = runner_module.LlamaRunner.run
    matches = 0

    def run_step(self: Any, work: Any) -> Any:
        nonlocal matches
        tokens = sum(stop - start for _, start, stop in work)
        decode = tokens == len(work)
        wanted = decode and len(work) == args.prompts if args.kind == "decode" else not decode
        matches += wanted
        start = time.perf_counter()
        if wanted and matches == args.skip + 1:
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                out = original(self, work)
            wall = time.perf_counter() - start
            table = prof.key_averages()
            total = sum(e.self_cpu_time_total for e in table)
            profiled.update(
                sequences=len(work),
                tokens=tokens,
                wall_ms=wall * 1e3,
                ops=[
                    {
                        "name": e.key,
                        "self_ms": e.self_cpu_time_total / 1e3,
                        "calls": e.count,
                        "share": e.self_cpu_time_total / total,
                    }
                    for e in sorted(table, key=lambda e: -e.self_cpu_time_total)[: args.top]
                ],
            )
        else:
            out = original(self, work)
            wall = time.perf_counter() - start
        steps.append({"sequences": len(work), "tokens": tokens, "wall_ms": wall * 1e3})
        return out

    setattr(runner_module.LlamaRunner, "run", run_step)  # noqa: B010 (time every step)
    try:
        with LLM(config=kvtier_engine_config(4, args.bf16)) as llm:
            warm = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
            llm.generate([random_ids(32, args.seed, 99)], warm)
            steps.clear()
            matches = 0
            params = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
            prompts = [random_ids(args.prompt_tokens, args.seed, i) for i in range(args.prompts)]
            llm.generate(prompts, params)
    finally:
        setattr(runner_module.LlamaRunner, "run", original)  # noqa: B010
    if not profiled:
        raise SystemExit(f"profile_step: no {args.kind} step #{args.skip + 1} in this run")
    like = [
        s["wall_ms"]
        for s in steps
        if s["sequences"] == profiled["sequences"] and s["tokens"] == profiled["tokens"]
    ]
    return {
        "profiled": profiled,
        "steps": steps,
        "summary": {
            "kind": args.kind,
            "profiled_wall_ms": profiled["wall_ms"],
            "unprofiled_median_ms_same_shape": median(like),
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = base_parser("profile_step", __doc__)
    parser.add_argument("--kind", choices=("decode", "prefill"), default="decode")
    parser.add_argument("--prompts", type=int, default=16, help="sequences in the batch")
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--skip", type=int, default=4, help="matching steps before the one")
    parser.add_argument("--threads", type=int, default=2, minimum=1)
    parser.add_argument("--top", type=int, default=15, help="operators listed")
    parser.add_argument("--bf16", action="store_true", help="bf16 weights (peers' --bf16)")
    args = parser.parse(argv)
    if args.quick:
        args.prompts, args.prompt_tokens, args.new_tokens, args.skip = 2, 64, 4, 0
    info = header()
    result = run(args)
    result["args"] = {k: v for k, v in vars(args).items() if k != "json"}
    p = result["profiled"]
    print(
        f"{args.kind} step: {p['sequences']} sequences, {p['tokens']} tokens, {p['wall_ms']:.0f} ms"
    )
    print(f"{'operator':<52}{'self ms':>10}{'calls':>8}{'share':>8}")
    for op in p["ops"]:
        print(f"{op['name'][:51]:<52}{op['self_ms']:>10.1f}{op['calls']:>8}{op['share']:>8.1%}")
    s = result["summary"]
    finish(
        args.json,
        result,
        info,
        f"summary: profiled {s['profiled_wall_ms']:.0f} ms; unprofiled steps of the same "
        f"shape: median {s['unprofiled_median_ms_same_shape']:.0f} ms",
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
