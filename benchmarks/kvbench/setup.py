"""Shared set-up of the model benchmarks: model and device flags, prompts, link
descriptions, engine configurations, and the decode cases.

``decode``, ``reuse`` and ``librarian`` load the model the same way (embedded, a folder, or
a random-weight shape), pin torch threads the same way, and describe links the same way;
``decode`` and ``librarian`` decode a prompt the same ways (resident ``DynamicCache``, its
offloading variant, a ``TieredCache`` adopting the prompt's chunks from a host tier); the
engine benchmarks size an ``EngineConfig`` by the same few budgets. This module holds that,
so each benchmark module keeps only its own question.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache

from kvbench.common import BenchParser, base_parser, memcpy_gbps
from kvtier.config import HostConfig, LinkConfig, ManagerConfig, PlacementRates, TieredCacheConfig
from kvtier.engine import EngineConfig
from kvtier.hf.cache import TieredCache
from kvtier.hf.generate import TokenClock, prefill
from kvtier.kv.layout import DTYPES, KVLayout
from kvtier.manager import KVManager
from kvtier.models import load_model, model_identity, random_model
from kvtier.transfer import Link, Throttle

STAGING_BYTES = 64 << 20


@dataclass(frozen=True)
class BenchModel:
    """A model under test, with what the cases need to know about it."""

    model: Any
    model_id: str
    layout: KVLayout
    device: torch.device
    description: str

    def greedy_kwargs(self, new_tokens: int) -> dict[str, Any]:
        """Exactly ``new_tokens`` greedy steps (EOS suppressed), the same for every case."""
        config = self.model.generation_config
        pad = config.pad_token_id if config.pad_token_id is not None else config.eos_token_id
        if isinstance(pad, list):
            pad = pad[0]
        return dict(
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0 if pad is None else pad,
        )


@dataclass
class DecodeRun:
    """One decode measurement.

    Attributes:
        step_s: seconds per decode step (first generated token to last, ÷ steps).
        bytes_per_step: link bytes host→device per decode step (0 for baselines).
        wait_s_per_step: seconds per step compute waited for the link.
        tokens: the generated ids.
        reused_tokens: prompt tokens adopted from the tiers.
        peak_extra_nbytes: peak device bytes during decode above the run's start (CUDA only).
        decided_chunks: kvtier's chunk reads of the whole run by decision (empty for
            baselines).
    """

    step_s: float
    bytes_per_step: float = 0.0
    wait_s_per_step: float = 0.0
    tokens: list[int] = field(default_factory=list)
    reused_tokens: int = 0
    peak_extra_nbytes: int | None = None
    decided_chunks: dict[str, int] = field(default_factory=dict)


class StepClock(TokenClock):
    """``TokenClock`` that also samples (link bytes, link wait seconds) at every token.

    On CUDA it resets the peak-memory counter at the first generated token, so the peak it
    reports covers decode only, above ``start_allocated`` (taken before the run's cache
    existed).
    """

    def __init__(
        self,
        counter: Callable[[], tuple[int, float]],
        device: torch.device,
        start_allocated: int = 0,
    ) -> None:
        super().__init__()
        self.counter = counter
        self.counts: list[tuple[int, float]] = []
        self.cuda = device.type == "cuda"
        self.start_allocated = start_allocated
        self.device = device

    def put(self, value: torch.Tensor) -> None:
        super().put(value)
        self.counts.append(self.counter())
        if self.cuda and len(self.times) == 2:
            torch.cuda.reset_peak_memory_stats(self.device)

    def run(self, sequences: torch.Tensor, prompt_len: int, reused: int = 0) -> DecodeRun:
        steps = len(self.times) - 2
        if steps < 1:
            raise RuntimeError("decode: fewer than 2 tokens were generated; raise --new-tokens")
        nbytes = self.counts[-1][0] - self.counts[1][0]
        wait_s = self.counts[-1][1] - self.counts[1][1]
        peak = None
        if self.cuda:
            peak = torch.cuda.max_memory_allocated(self.device) - self.start_allocated
        return DecodeRun(
            step_s=(self.times[-1] - self.times[1]) / steps,
            bytes_per_step=nbytes / steps,
            wait_s_per_step=wait_s / steps,
            tokens=sequences[0, prompt_len:].tolist(),
            reused_tokens=reused,
            peak_extra_nbytes=peak,
        )


def allocated_nbytes(device: torch.device) -> int:
    """Bytes torch has allocated on a CUDA device now (0 elsewhere)."""
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def use_stock_attention(model: Any) -> None:
    """Baselines run transformers' own SDPA attention (kvtier re-attaches itself)."""
    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        model.set_attn_implementation("sdpa")


def random_prompt(vocab_size: int, tokens: int, seed: int) -> torch.Tensor:
    """``[1, tokens]`` seeded random token ids."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (1, tokens), generator=gen)


def model_parser(name: str, doc: str | None) -> BenchParser:
    """``base_parser`` with the flags choosing the model, its dtype, the device and the CPU
    threads (``load_bench`` reads them)."""
    parser = base_parser(name, doc)
    parser.add_argument(
        "--model", default=None, help="HF model folder or .gguf (default: embedded)"
    )
    parser.add_argument(
        "--random-shape", default=None, help="random-weight llama of this shape (e.g. llama3-8b)"
    )
    parser.add_argument("--dtype", default="float32", help=f"one of {sorted(DTYPES)}")
    parser.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        minimum=1,
        help="torch threads (CPU default 1: compute on one core, the link's copies on another)",
    )
    return parser


def setup_device(args: argparse.Namespace) -> torch.device:
    """The device of ``--device``; on a CPU also fixes torch's thread count.

    One compute thread on a CPU: the link's worker copies on the other core (as a GPU's copy
    engine does beside its SMs), and a shared machine's other load does not stall torch's
    thread barriers (two threads ran a decode step 5x slower than one under load here).
    """
    torch.manual_seed(args.seed)
    if args.device is not None:
        device = torch.device(args.device)
    else:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.threads is not None or device.type == "cpu":
        torch.set_num_threads(args.threads or 1)
    return device


def load_bench(args: argparse.Namespace, max_tokens: int) -> BenchModel:
    """The device of ``--device`` (``setup_device``) and the model of ``model_parser``'s
    flags on it (``load_bench_model``)."""
    return load_bench_model(args, setup_device(args), max_tokens)


def load_bench_model(args: argparse.Namespace, device: torch.device, max_tokens: int) -> BenchModel:
    """The embedded model, ``--model PATH``, or random weights of ``--random-shape``.

    Raises:
        ValueError: a bad ``--dtype``, or ``max_tokens`` beyond the model's context.
    """
    if args.dtype not in DTYPES:
        raise ValueError(f"--dtype: unknown {args.dtype!r}; accepted: {sorted(DTYPES)}")
    dtype = DTYPES[args.dtype]
    if args.random_shape is not None:
        model = random_model(
            "llama",
            shape=args.random_shape,
            seed=args.seed,
            dtype=dtype,
            device=device,
            max_position_embeddings=max(8192, max_tokens),
        )
        model_id = model_identity(model)
        description = f"random-weight llama, shape {args.random_shape}, {args.dtype}"
    else:
        loaded = load_model(args.model, dtype=dtype, device=device)
        model, model_id = loaded.model, loaded.model_id
        description = f"{model_id} ({args.dtype})"
    limit = int(getattr(model.config, "max_position_embeddings", max_tokens))
    if max_tokens > limit:
        raise ValueError(
            f"--context: {max_tokens} tokens (prompt and new tokens) exceed the model's context "
            f"of {limit}; pass a smaller --context"
        )
    layout = KVLayout.from_model_config(model.config, dtype, 256)
    return BenchModel(model, model_id, layout, device, description)


def link_gbps(device: torch.device) -> tuple[float, str]:
    """The real host→device link: pinned ``copy_`` on a side stream (CUDA) or memcpy."""
    if device.type != "cuda":
        return memcpy_gbps(256 << 20), "memcpy (host and device are both CPU memory)"
    nbytes = 256 << 20
    src = torch.ones(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    stream = torch.cuda.Stream(device=device)
    best = 0.0
    with torch.cuda.stream(stream):
        for _ in range(3):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            dst.copy_(src, non_blocking=True)
            end.record(stream)
            end.synchronize()
            best = max(best, nbytes / (start.elapsed_time(end) / 1e3) / 1e9)
    return best, "pinned host->device copy_ of 256 MiB on a side stream"


def describe_link(gbps: float | None, device: torch.device) -> str:
    """What ``TieredCache.stats().link_description`` reports for a link of ``gbps`` (None: real)."""
    throttle = Throttle(gbps) if gbps is not None else None
    link = Link("host->device", 1, throttle, device if device.type == "cuda" else None)
    try:
        return link.describe()
    finally:
        link.close()


# ---- the cases -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    """The model and the prompt every case decodes."""

    bench: BenchModel
    prompt: torch.Tensor  # [1, S]
    new_tokens: int

    @property
    def model(self) -> Any:
        return self.bench.model

    @property
    def layout(self) -> KVLayout:
        return self.bench.layout

    @property
    def device(self) -> torch.device:
        return self.bench.device

    @property
    def final_kv_nbytes(self) -> int:
        return self.layout.kv_nbytes(self.prompt.shape[1] + self.new_tokens)

    def greedy_kwargs(self) -> dict[str, Any]:
        return self.bench.greedy_kwargs(self.new_tokens)


def budget_bytes_of(work: Workload, fraction: float) -> int:
    """``fraction`` of the final KV, at least the one tail chunk the cache needs."""
    return max(int(fraction * work.final_kv_nbytes), work.layout.chunk_nbytes)


@torch.no_grad()
def prefill_dynamic(work: Workload) -> DynamicCache:
    """The prompt but its last token in a resident ``DynamicCache`` (kept, copied per run)."""
    use_stock_attention(work.model)
    cache = DynamicCache(config=work.model.config)
    ids = work.prompt[:, :-1].to(work.device)
    work.model(ids, cache=cache, use_cache=True, logits_to_keep=1)
    return cache


def decode_dynamic(work: Workload, prefilled: DynamicCache | None) -> DecodeRun:
    """Resident baseline (from a copy of ``prefilled``), or ``offloading=True`` when None."""
    use_stock_attention(work.model)
    clock = StepClock(lambda: (0, 0.0), work.device, allocated_nbytes(work.device))
    if prefilled is not None:
        cache = copy.deepcopy(prefilled)
    else:
        cache = DynamicCache(config=work.model.config, offloading=True)
    ids = work.prompt.to(work.device)
    out = work.model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        cache=cache,
        streamer=clock,
        **work.greedy_kwargs(),
    )
    del cache
    return clock.run(out, ids.shape[1])


def new_manager(work: Workload, host_codec: str = "raw") -> KVManager:
    """A host tier holding the whole context (the KV every kvtier case streams from), its
    chunks stored in ``host_codec``."""
    layout = work.layout
    host_nbytes = work.final_kv_nbytes + 4 * layout.chunk_nbytes
    config = ManagerConfig(
        chunk_tokens=layout.chunk_tokens,
        host=HostConfig(capacity_bytes=host_nbytes, codec=host_codec),
    )
    return KVManager(layout, work.bench.model_id, config)


def decode_tiered(
    work: Workload,
    manager: KVManager,
    budget_bytes: int,
    gbps: float | None,
    prefetch: bool,
    staging_bytes: int = STAGING_BYTES,
    placement: str = "stream",
    rates: PlacementRates | None = None,
) -> DecodeRun:
    """A fresh ``TieredCache``: reuse the cached prompt chunks, prefill the rest, decode.
    ``placement`` (and ``rates`` for ``auto``) say where the chunks past the budget are
    attended; the run records the chunk reads by decision."""
    start_allocated = allocated_nbytes(work.device)
    config = TieredCacheConfig(
        device_budget_bytes=budget_bytes,
        staging_bytes=staging_bytes,
        prefetch=prefetch,
        link=LinkConfig(gbps=gbps),
        placement=placement,
        rates=rates,
    )
    cache = TieredCache(work.model, config, manager=manager, model_id=work.bench.model_id)
    try:
        ids = work.prompt.to(work.device)
        reused = prefill(work.model, cache, ids)

        def link_counters() -> tuple[int, float]:
            link = cache.stats().link
            return link.bytes, link.wait_s

        clock = StepClock(link_counters, work.device, start_allocated)
        out = work.model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            cache=cache,
            streamer=clock,
            **work.greedy_kwargs(),
        )
        run = clock.run(out, ids.shape[1], reused)
        return dataclasses.replace(run, decided_chunks=cache.stats().decided_chunks)
    finally:
        cache.close()


# ---- the engine ------------------------------------------------------------------------------


def engine_config(
    max_batch_size: int,
    device_budget_bytes: int,
    host_bytes: int,
    chunk_tokens: int,
    **engine: Any,
) -> EngineConfig:
    """An engine of ``max_batch_size`` sequences, each with ``device_budget_bytes`` of
    device KV, over a host tier of ``host_bytes`` in ``chunk_tokens`` chunks; ``engine``:
    any other ``EngineConfig`` field (``prefill_tokens_per_step``, ``max_queued`` …)."""
    return EngineConfig(
        max_batch_size=max_batch_size,
        cache=TieredCacheConfig(device_budget_bytes=device_budget_bytes),
        manager=ManagerConfig(
            chunk_tokens=chunk_tokens, host=HostConfig(capacity_bytes=host_bytes)
        ),
        **engine,
    )
