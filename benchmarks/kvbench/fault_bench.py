"""What every ``bench faults`` scenario shares: the model, the engine configurations with
the tiers a scenario asks for, one request's figures, and the score against the fault-free
run (``kvbench.faults`` runs the scenarios; ``kvbench.faults_disk`` has the disk ones).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from kvbench.redis_cluster import RedisCluster
from kvtier.config import DiskConfig, RemoteConfig
from kvtier.engine import Engine, EngineConfig, SamplingParams
from kvtier.hf import model_spec

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@dataclasses.dataclass
class Bench:
    """What every scenario needs: the model, a config builder and the prompts."""

    model: Any
    tokenizer: Any
    base: EngineConfig  # no lower tiers; the scenarios add theirs
    prompts: list[list[int]]
    timeout_s: float = 0.5
    reference: list[list[int]] = dataclasses.field(default_factory=list)

    def config(
        self,
        cluster: RedisCluster | None,
        prefix: str,
        disk: str | None = None,
        write_policy: str | None = None,
    ) -> EngineConfig:
        """The base config with a disk tier at ``disk`` and the shared tier on ``cluster``
        under ``prefix`` (each where given), and ``write_policy`` (None: the base's)."""
        tiers: list[Any] = []
        if disk is not None:
            tiers.append(DiskConfig(path=disk, fsync=False))
        if cluster is not None:
            tiers.append(
                RemoteConfig(
                    url=cluster.url,
                    key_prefix=prefix,
                    cluster=True,
                    timeout_s=self.timeout_s,
                    retry_after_s=1.0,
                )
            )
        manager = dataclasses.replace(
            self.base.manager,
            lower_tiers=tuple(tiers),
            write_policy=write_policy or self.base.manager.write_policy,
        )
        return dataclasses.replace(self.base, manager=manager)

    def chunk_nbytes(self) -> int:
        """Bytes of one chunk of this model's KV at the base config's chunk size."""
        return model_spec(self.model, self.base.manager.chunk_tokens).layout.chunk_nbytes

    def serve(self, config: EngineConfig, prompts: list[list[int]]) -> list[dict[str, Any]]:
        """Each prompt, one at a time, on a new engine; per request its tokens, TTFT and
        reused tokens (None tokens: it failed)."""
        with Engine(self.model, self.tokenizer, config) as engine:
            return [serve_one(engine, p) for p in prompts]


def serve_one(engine: Engine, prompt: list[int]) -> dict[str, Any]:
    start = time.perf_counter()
    try:
        handle = engine.submit(prompt, GREEDY)
        first, events = None, []
        for event in handle:  # the stream is consumed here: the completion is built from it
            if first is None and event.token_id is not None:
                first = time.perf_counter() - start
            events.append(event)
        out = handle.completion_of(events)
    except Exception as exc:
        return {"tokens": None, "error": repr(exc), "ttft_s": None, "reused": 0}
    done = out.finish_reason in ("length", "stop")
    return {"tokens": out.token_ids if done else None, "ttft_s": first, "reused": out.reused_tokens}


def score(bench: Bench, runs: list[dict[str, Any]], prompts: list[list[int]]) -> dict[str, int]:
    """Requests, those that did not complete (``lost``) and those whose tokens differ from
    the fault-free run's (``wrong``); ``prompts`` are the bench's, in the order run."""
    index = {tuple(p): i for i, p in enumerate(bench.prompts)}
    lost = sum(r["tokens"] is None for r in runs)
    wrong = sum(
        r["tokens"] is not None and r["tokens"] != bench.reference[index[tuple(p)]]
        for r, p in zip(runs, prompts, strict=True)
    )
    return {"requests": len(runs), "lost": lost, "wrong": wrong}
