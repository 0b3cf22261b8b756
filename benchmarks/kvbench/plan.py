"""Benchmark ``plan``: does ``kvtier plan`` predict the decode steps kvtier runs here?

Question: for configurations kvtier's engine runs on this machine (context × decode batch
× where the KV is: all resident, 10 % resident with the rest streamed over the real or a
throttled link, or attended on the host), how far is the planner's predicted decode step
from the measured one (``plan_max_error``), and is the resource it names as binding the
one the step moves with?

Method. The planner reads this machine's ``kvtier calibrate`` profile of the model (one is
measured first if none matches). Every configuration is a fresh ``Engine`` at one torch
thread over one shared host tier, so each prompt is computed once and adopted after; its
step is the median gap between the first request's tokens while every request decodes.
The binding checks rerun two configurations: streaming where the planner says the link
binds, with the link throttled 30 % more (the step should grow by about as much), and host
attention, whose binding resource is not the link, with the link throttled 5× (the step
should not move).
"""

from __future__ import annotations

import dataclasses
import random
import statistics
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvbench.common import base_parser, finish, header
from kvtier.calibrate import Settings, calibrate_model
from kvtier.config import HostConfig, LinkConfig, ManagerConfig, TieredCacheConfig
from kvtier.engine import Engine, EngineConfig, SamplingParams
from kvtier.manager import KVManager
from kvtier.models import load_model
from kvtier.plan import from_profile, model_shape
from kvtier.plan.predict import decode_step
from kvtier.profiles import load_profile, save_profile

CHUNK = 256
NEW_TOKENS = 16
CHECK_RUNS = 3  # each binding check's configuration, the fastest kept


@dataclass(frozen=True)
class Config:
    """One configuration to predict and run."""

    context: int
    batch: int
    strategy: str  # "resident", "stream" or "host"
    budget: float  # share of the KV on the device
    link_gbps: float | None = None  # a throttle; None: the real link

    @property
    def name(self) -> str:
        link = "" if self.link_gbps is None else f" @{self.link_gbps:g} GB/s"
        return f"{self.context}x{self.batch} {self.strategy} {self.budget:.0%}{link}"


def configs(contexts: tuple[int, ...], link_bound_gbps: float) -> list[Config]:
    out: list[Config] = []
    for context in contexts:
        for batch in (1, 2):
            out.append(Config(context, batch, "resident", 1.0))
            out.append(Config(context, batch, "stream", 0.1))
            out.append(Config(context, batch, "host", 0.1))
        out.append(Config(context, 1, "stream", 0.1, link_bound_gbps))
    return out


def measure(
    loaded: Any, manager: KVManager, config: Config, prompts: list[list[int]]
) -> tuple[float, list[list[int]]]:
    """The engine's decode step (seconds) and every request's tokens."""
    layout = manager.layout
    final = config.context + NEW_TOKENS + 1
    budget = max(2 * layout.chunk_nbytes, int(config.budget * layout.kv_nbytes(final)))
    if config.strategy == "resident":
        budget = layout.kv_nbytes(final) + 2 * layout.chunk_nbytes
    cache = TieredCacheConfig(
        device_budget_bytes=budget,
        placement="host" if config.strategy == "host" else "stream",
        link=LinkConfig(gbps=config.link_gbps),
    )
    engine_config = EngineConfig(max_batch_size=config.batch, cache=cache)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    with Engine(
        loaded.model, loaded.tokenizer, engine_config, model_id=loaded.model_id, manager=manager
    ) as engine:
        handles = [engine.submit(ids, params) for ids in prompts[: config.batch]]
        stamps = [time.perf_counter() for e in handles[0] if e.token_id is not None]
        tokens = [handles[0].result().token_ids] + [h.result().token_ids for h in handles[1:]]
    gaps = np.diff(np.asarray(stamps[3:-2]))  # every request decoding
    return float(np.median(gaps)), tokens


def run(contexts: tuple[int, ...], repeats: int, seed: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    loaded = load_model()
    profile = load_profile(loaded.model_id)
    if profile is None:
        print("no calibration profile of the model here: measuring one (kvtier calibrate)")
        profile = calibrate_model(
            loaded.model, loaded.tokenizer, loaded.model_id, Settings(), progress=True
        )
        save_profile(profile)
    hw = from_profile(profile)
    shape = model_shape(None, dtype_bytes=4)
    layout_nbytes = shape.kv_bytes_per_token * (max(contexts) + NEW_TOKENS + CHUNK) * 2
    manager = KVManager(
        _layout(loaded),
        loaded.model_id,
        ManagerConfig(
            chunk_tokens=CHUNK, host=HostConfig(capacity_bytes=len(contexts) * layout_nbytes)
        ),
    )
    rng = random.Random(seed)
    vocab = int(loaded.model.config.vocab_size)
    prompts = {
        c: [[rng.randrange(10, vocab) for _ in range(c)] for _ in range(2)] for c in contexts
    }
    # The link-bound throttle: streaming the longest context's 90 % at 2.5x its resident step.
    longest = max(contexts)
    resident = decode_step(shape, hw, 1, longest, 1.0, "resident").seconds
    link_bound = float(f"{0.9 * longest * shape.kv_bytes_per_token / (2.5 * resident) / 1e9:.2g}")
    todo = configs(contexts, link_bound)
    started = time.perf_counter()
    runs: dict[str, list[float]] = {c.name: [] for c in todo}
    reference: dict[tuple[int, int], list[list[int]]] = {}
    identical = True
    for round_ in range(repeats):
        for config in todo:
            step, tokens = measure(loaded, manager, config, prompts[config.context])
            runs[config.name].append(step)
            key = (config.context, config.batch)
            if config.strategy == "resident" and key not in reference:
                reference[key] = tokens
            identical &= reference.get(key, tokens) == tokens
        print(f"round {round_ + 1}/{repeats} ({time.perf_counter() - started:.0f} s)")
    results = {}
    for config in todo:
        predicted = predict(shape, hw, config)
        measured = min(runs[config.name])  # noise on a shared machine only adds
        results[config.name] = {
            **dataclasses.asdict(config),
            "predicted_s": predicted.seconds,
            "binding": predicted.binding,
            "busy_s": predicted.busy_s,
            "measured_s": measured,
            "measured_all_s": runs[config.name],
            "error": predicted.seconds / measured - 1,
        }
    checks = binding_checks(loaded, manager, shape, hw, prompts, longest, link_bound)
    manager.close()
    errors = [abs(r["error"]) for r in results.values()]
    return {
        "summary": {
            "plan_max_error": max(errors),
            "plan_median_error": statistics.median(errors),
            "configs": len(results),
            "binding_confirmed": all(c["confirmed"] for c in checks.values()),
            "tokens_identical": identical,
        },
        "configs": results,
        "binding_checks": checks,
        "hardware": dataclasses.asdict(hw),
        "link_bound_gbps": link_bound,
        "seconds": time.perf_counter() - started,
    }


def predict(shape: Any, hw: Any, config: Config) -> Any:
    context = config.context + NEW_TOKENS // 2  # the middle of the decode
    return decode_step(
        shape, hw, config.batch, context, config.budget, config.strategy, config.link_gbps
    )


def binding_checks(
    loaded: Any,
    manager: KVManager,
    shape: Any,
    hw: Any,
    prompts: dict[int, list[list[int]]],
    context: int,
    link_bound: float,
) -> dict[str, dict[str, Any]]:
    """Throttle the binding resource and the step moves; throttle another and it does not."""
    pairs = {
        "stream, link binds: link 30 % slower": (
            Config(context, 1, "stream", 0.1, link_bound),
            Config(context, 1, "stream", 0.1, link_bound * 0.7),
        ),
        "host, compute binds: link 5x slower": (
            Config(context, 1, "host", 0.1, link_bound),
            Config(context, 1, "host", 0.1, link_bound / 5),
        ),
    }
    out = {}
    for name, (base, slower) in pairs.items():
        steps = [
            min(measure(loaded, manager, c, prompts[context])[0] for _ in range(CHECK_RUNS))
            for c in (base, slower)
        ]
        moved = steps[1] / steps[0] - 1
        binding = predict(shape, hw, base).binding
        expect_move = binding == "link"
        confirmed = moved > 0.15 if expect_move else abs(moved) < 0.1
        out[name] = {
            "binding": binding,
            "step_s": steps[0],
            "throttled_step_s": steps[1],
            "moved": moved,
            "predicted_moved": predict(shape, hw, slower).seconds / predict(shape, hw, base).seconds
            - 1,
            "confirmed": confirmed,
        }
    return out


def _layout(loaded: Any) -> Any:
    from kvtier.kv import KVLayout

    return KVLayout.from_model_config(loaded.model.config, torch.float32, CHUNK)


def main(argv: list[str] | None = None) -> int:
    parser = base_parser("plan", __doc__)
    parser.sized("--contexts", "2048,4096", "1024", "comma-separated")
    parser.sized("--repeats", 2, 1, "rounds", type=int)
    args = parser.parse(argv)
    contexts = tuple(int(c) for c in args.contexts.split(","))
    info = header()
    result = run(contexts, args.repeats, args.seed)
    print(f"{'config':<32}{'predicted ms':>13}{'measured ms':>12}{'error':>8}  binding")
    for name, r in result["configs"].items():
        print(
            f"{name:<32}{r['predicted_s'] * 1e3:>13.1f}{r['measured_s'] * 1e3:>12.1f}"
            f"{r['error']:>+8.1%}  {r['binding']}"
        )
    for name, c in result["binding_checks"].items():
        print(
            f"{name}: step {c['step_s'] * 1e3:.1f} -> {c['throttled_step_s'] * 1e3:.1f} ms "
            f"({c['moved']:+.0%}; predicted {c['predicted_moved']:+.0%}); "
            f"confirmed {c['confirmed']}"
        )
    s = result["summary"]
    finish(
        args.json,
        result,
        info,
        f"summary: plan_max_error {s['plan_max_error']:.1%} over {s['configs']} configs "
        f"(median {s['plan_median_error']:.1%}), binding confirmed {s['binding_confirmed']}, "
        f"tokens identical {s['tokens_identical']}",
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
