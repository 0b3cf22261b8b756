"""``kvtier serve``: load a model, start the engine, serve the OpenAI API with uvicorn.

SIGINT/SIGTERM stop the server gracefully: uvicorn stops accepting connections and waits
for in-flight responses, then the engine drains its queue and, with ``--disk-dir``, writes
the host tier to disk, so a restart on the same directory finds the sessions' KV. The
drain lasts at most ``--drain-timeout`` seconds; what is left then is cancelled. If the
engine's worker dies, ``/health`` answers 503 and the process exits with status 1, so a
supervisor restarts it.
"""

from __future__ import annotations

import argparse
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

from kvtier.config import (
    CODEC_HELP,
    CODEC_NAMES,
    PLACEMENTS,
    WRITE_POLICIES,
    HostConfig,
    LowerTierConfig,
    ManagerConfig,
    MiB,
    TieredCacheConfig,
    lower_tiers_of,
)
from kvtier.policy import EVICTION_POLICIES
from kvtier.server.config import KEYS_ENV, ServerConfig, read_api_keys

if TYPE_CHECKING:
    import uvicorn

    from kvtier.engine import Engine, EngineConfig


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="kvtier serve", description="OpenAI-compatible server over kvtier's tiered KV cache"
    )
    parser.add_argument("--model", default=None, help="HF folder or .gguf (default: embedded)")
    parser.add_argument("--served-model-name", default=None, help="the `model` clients send")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--api-key",
        action="append",
        default=[],
        help="accept 'Authorization: Bearer KEY' (repeatable; visible in ps: prefer "
        f"--api-key-file or ${KEYS_ENV})",
    )
    parser.add_argument(
        "--api-key-file",
        action="append",
        default=[],
        help=f"a file of accepted keys, one per line (repeatable); ${KEYS_ENV} adds more",
    )
    parser.add_argument(
        "--salt-by-key",
        action="store_true",
        help="each API key is its own tenant: KV is never reused across keys",
    )
    parser.add_argument(
        "--metrics-need-key", action="store_true", help="/metrics needs an API key too"
    )
    parser.add_argument(
        "--max-body-mb",
        type=float,
        default=None,
        help="largest request body accepted, 413 above (default: 4 bytes per prompt "
        "character accepted, at least 1 MiB)",
    )
    parser.add_argument(
        "--max-prompt-chars",
        type=int,
        default=None,
        help="longest text prompt accepted, before tokenizing (default: 64 per context token)",
    )
    parser.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="seconds SIGTERM waits for in-flight requests before cancelling them",
    )
    parser.add_argument("--max-queued", type=int, default=64, help="waiting requests; then 429")
    parser.add_argument(
        "--max-queue-s",
        type=float,
        default=120.0,
        help="admission by cost: 429 when the predicted seconds of the work ahead and the "
        "request's own exceed this (0: count bound only)",
    )
    parser.add_argument(
        "--device-budget-mb", type=int, default=128, help="device KV budget per sequence"
    )
    parser.add_argument(
        "--runner",
        choices=("auto", "kvtier", "transformers"),
        default="auto",
        help="the model's forward: kvtier's own for the Llama family (auto), or transformers'",
    )
    low = (
        "projections, long prefill attention and the KV in bf16: faster, tokens drift "
        "(default: the weights' dtype, exact)"
    )
    parser.add_argument("--matmul-dtype", choices=("bfloat16",), default=None, help=low)
    parser.add_argument(
        "--max-batch-size",
        type=int,
        default=8,
        help="sequences run together (continuous batching; 1 = one at a time)",
    )
    parser.add_argument(
        "--prefill-tokens-per-step",
        type=int,
        default=None,
        help="prompt tokens per step's forward (default: one chunk; more: throughput over "
        "inter-token latency)",
    )
    parser.add_argument(
        "--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)"
    )
    parser.add_argument("--host-mb", type=int, default=1024, help="host DRAM tier size")
    parser.add_argument("--disk-dir", default=None, help="keep KV on disk here (survives restarts)")
    parser.add_argument("--disk-mb", type=int, default=32 * 1024, help="disk tier size")
    for tier in ("host", "disk", "remote"):
        parser.add_argument(
            f"--{tier}-codec",
            choices=CODEC_NAMES,
            default="raw",
            help=f"the {tier} tier's chunk format: {CODEC_HELP}",
        )
    parser.add_argument(
        "--remote",
        default=None,
        metavar="URL",
        help="a Redis (Cluster) every instance shares, below host and disk: "
        "redis://[user:password@]host:port (rediss:// for TLS; any node of a cluster)",
    )
    parser.add_argument(
        "--remote-prefix", default="kvtier", help="the shared tier's key prefix (ACL: ~PREFIX:*)"
    )
    parser.add_argument(
        "--remote-ttl-s", type=float, default=24 * 3600.0, help="shared chunks expire after this"
    )
    parser.add_argument(
        "--remote-mb",
        type=int,
        default=64 * 1024,
        help="the most this instance keeps in the shared tier (its least recently used "
        "values are deleted past it)",
    )
    parser.add_argument(
        "--remote-timeout-s",
        type=float,
        default=0.5,
        help="each call to the shared tier gives up after this (the KV is then recomputed)",
    )
    parser.add_argument(
        "--write-policy",
        choices=WRITE_POLICIES,
        default="write_back",
        help="write_through: sealed chunks go to disk as they seal (survives kill -9); "
        "write_back: only on eviction or shutdown",
    )
    parser.add_argument("--chunk-tokens", type=int, default=256, help="tokens per KV chunk")
    parser.add_argument(
        "--eviction-policy",
        choices=sorted(EVICTION_POLICIES),
        default="lru",
        help="which chunk host and disk evict first: lru, fifo, s3fifo, arc; NAME+prefix "
        "also keeps a chunk until its held children are gone (docs/benchmarks.md, bench "
        "eviction)",
    )
    parser.add_argument(
        "--placement",
        choices=PLACEMENTS,
        default="stream",
        help="non-resident KV: stream it to the device, attend it on the host, or auto "
        "(the cost model, from this machine's `kvtier calibrate` profile)",
    )
    parser.add_argument("--log-level", default="info", help="uvicorn log level")
    return parser.parse_args(argv)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """Map the flags onto the engine's config (validation errors name the flag or field)."""
    from kvtier.engine import EngineConfig

    for flag in (
        "max_queued",
        "device_budget_mb",
        "max_batch_size",
        "host_mb",
        "disk_mb",
        "chunk_tokens",
    ):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')}: must be >= 1, got {getattr(args, flag)}")
    for flag in ("prefill_tokens_per_step", "threads"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise ValueError(f"--{flag.replace('_', '-')}: must be >= 1, got {value}")
    if args.max_queue_s < 0:
        raise ValueError(f"--max-queue-s: must be >= 0, got {args.max_queue_s}")
    return EngineConfig(
        max_queued=args.max_queued,
        max_queue_s=args.max_queue_s or None,
        max_batch_size=args.max_batch_size,
        prefill_tokens_per_step=args.prefill_tokens_per_step,
        runner=args.runner,
        matmul_dtype=args.matmul_dtype,
        cache=TieredCacheConfig(
            device_budget_bytes=args.device_budget_mb * MiB, placement=args.placement
        ),
        manager=ManagerConfig(
            chunk_tokens=args.chunk_tokens,
            write_policy=args.write_policy,
            host=HostConfig(
                capacity_bytes=args.host_mb * MiB,
                eviction_policy=args.eviction_policy,
                codec=args.host_codec,
            ),
            lower_tiers=lower_tiers(args),
        ),
    )


def lower_tiers(args: argparse.Namespace) -> tuple[LowerTierConfig, ...]:
    """The tiers below host the flags ask for: disk, then the shared one."""
    return lower_tiers_of(
        args.disk_dir,
        args.disk_mb,
        args.remote,
        args.remote_prefix,
        args.remote_ttl_s,
        args.remote_timeout_s,
        args.remote_mb,
        args.disk_codec,
        args.remote_codec,
        args.eviction_policy,
    )


def server_config(args: argparse.Namespace) -> ServerConfig:
    """Map the flags (and ``$KVTIER_API_KEYS``) onto the server's config."""
    if not args.drain_timeout >= 0:
        raise ValueError(f"--drain-timeout: must be >= 0 seconds, got {args.drain_timeout}")
    if args.max_body_mb is not None and not args.max_body_mb > 0:
        raise ValueError(f"--max-body-mb: must be > 0, got {args.max_body_mb}")
    keys = read_api_keys(args.api_key, args.api_key_file)
    if (args.salt_by_key or args.metrics_need_key) and not keys:
        flag = "--salt-by-key" if args.salt_by_key else "--metrics-need-key"
        raise ValueError(f"{flag}: needs API keys (--api-key-file or ${KEYS_ENV})")
    return ServerConfig(
        api_keys=keys,
        salt_by_key=args.salt_by_key,
        metrics_need_key=args.metrics_need_key,
        max_body_bytes=None if args.max_body_mb is None else max(1, int(args.max_body_mb * MiB)),
        max_prompt_chars=args.max_prompt_chars,
    )


def listen(host: str, port: int) -> socket.socket:
    """Bind the listening socket before loading the model, so a busy port fails at once."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(
            f"cannot listen on {host}:{port}: {exc.strerror or exc}; pick another --port or "
            "stop the process using it"
        ) from None
    sock.set_inheritable(True)
    return sock


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)  # before the heavy imports, so --help and bad flags are quick
    config = engine_config(args)
    served = server_config(args)
    if args.api_key:
        say("warning: --api-key is visible to every user in ps; prefer --api-key-file")
    sock = listen(args.host, args.port)
    import uvicorn

    from kvtier.calibrate import ensure_profile
    from kvtier.engine import Engine
    from kvtier.models import load_model
    from kvtier.server.app import create_app

    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    status = 0
    try:
        say(f"loading {args.model or 'the embedded model'}…")
        loaded = load_model(args.model)
        if config.cache.placement == "auto":  # the cost model needs this machine's rates
            ensure_profile(loaded.model, loaded.tokenizer, loaded.model_id)
        engine = Engine(loaded.model, loaded.tokenizer, config, model_id=loaded.model_id)
        say(f"model runner: {engine.runner.name}")
        name = args.served_model_name or _default_name(args.model)
        app = create_app(engine, name, served)
        say(f"serving {name!r} on http://{args.host}:{args.port}/v1 (Ctrl-C or SIGTERM stops)")
        server = uvicorn.Server(
            uvicorn.Config(
                app,
                log_level=args.log_level,
                timeout_graceful_shutdown=max(1, round(args.drain_timeout)),
            )
        )
        watchdog = _Watchdog(engine, server)
        # uvicorn handles SIGINT/SIGTERM itself (stop accepting, finish open responses) and
        # then re-raises the signal with the handlers it found; these make that re-raise a
        # no-op, so the engine still drains and flushes below instead of the process dying.
        previous = {sig: signal.signal(sig, _ignore) for sig in (signal.SIGINT, signal.SIGTERM)}
        stopped = False
        drain_from = time.monotonic()
        try:
            server.run(sockets=[sock])
            drain_from = watchdog.stop_requested_s or time.monotonic()
        finally:
            watchdog.stop()
            for sig, handler in previous.items():
                signal.signal(sig, handler)  # a second Ctrl-C now interrupts the drain
            flush = " and writing KV to disk" if args.disk_dir else ""
            say(f"draining in-flight requests{flush}")
            left = max(0.0, args.drain_timeout - (time.monotonic() - drain_from))
            stopped = engine.close(drain=True, timeout_s=left)
        if watchdog.dead is not None:
            say(f"error: the engine's worker died ({watchdog.dead}); exiting for a restart")
            status = 1
        elif not stopped:
            say("error: a request was still inside a model step after the drain timeout")
            status = 1
    finally:
        sock.close()
    stats = engine.stats()
    say(
        f"stopped after {stats.requests_finished} requests; {stats.reused_tokens} of "
        f"{stats.prompt_tokens} prompt tokens reused"
    )
    return status


class _Watchdog:
    """Stops the server when the engine's worker dies (``dead`` says why), and notes when
    a signal asked uvicorn to stop (the drain timeout counts from then)."""

    def __init__(self, engine: Engine, server: uvicorn.Server) -> None:
        self.engine = engine
        self.server = server
        self.dead: str | None = None
        self.stop_requested_s: float | None = None
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="kvtier-watchdog", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stopped.wait(0.2):
            if self.stop_requested_s is None and self.server.should_exit:
                self.stop_requested_s = time.monotonic()
            dead = self.engine.dead_reason
            if dead is not None and self.dead is None:
                self.dead = dead
                self.server.should_exit = True

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join()


def _ignore(sig: int, frame: FrameType | None) -> None:
    return None


def _default_name(model: str | None) -> str:
    if model is None:
        from kvtier.models import EMBEDDED_NAME

        return EMBEDDED_NAME
    path = Path(model)
    return path.stem if path.suffix == ".gguf" else path.name


def say(message: str) -> None:
    print(f"kvtier: {message}", file=sys.stderr, flush=True)
