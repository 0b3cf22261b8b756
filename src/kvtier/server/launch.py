"""``kvtier serve``: load a model, start the engine, serve the OpenAI API with uvicorn.

SIGINT/SIGTERM stop the server gracefully: uvicorn stops accepting connections and waits
for in-flight responses, then the engine drains its queue and, with ``--disk-dir``, writes
the host tier to disk, so a restart on the same directory finds the sessions' KV.
"""

from __future__ import annotations

import argparse
import signal
import socket
import sys
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

from kvtier.config import DiskConfig, HostConfig, ManagerConfig, MiB, TieredCacheConfig

if TYPE_CHECKING:
    from kvtier.engine import EngineConfig


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="kvtier serve", description="OpenAI-compatible server over kvtier's tiered KV cache"
    )
    parser.add_argument("--model", default=None, help="HF folder or .gguf (default: embedded)")
    parser.add_argument("--served-model-name", default=None, help="the `model` clients send")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
    parser.add_argument("--max-queued", type=int, default=64, help="waiting requests; then 429")
    parser.add_argument(
        "--device-budget-mb", type=int, default=128, help="device KV budget per sequence"
    )
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
    parser.add_argument("--chunk-tokens", type=int, default=256, help="tokens per KV chunk")
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
    return EngineConfig(
        max_queued=args.max_queued,
        max_batch_size=args.max_batch_size,
        prefill_tokens_per_step=args.prefill_tokens_per_step,
        cache=TieredCacheConfig(device_budget_bytes=args.device_budget_mb * MiB),
        manager=ManagerConfig(
            chunk_tokens=args.chunk_tokens,
            host=HostConfig(capacity_bytes=args.host_mb * MiB),
            disk=DiskConfig(path=args.disk_dir, capacity_bytes=args.disk_mb * MiB),
        ),
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
    sock = listen(args.host, args.port)
    import uvicorn

    from kvtier.engine import Engine
    from kvtier.server.app import create_app

    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    try:
        say(f"loading {args.model or 'the embedded model'}…")
        engine = Engine.from_pretrained(args.model, config)
        name = args.served_model_name or _default_name(args.model)
        app = create_app(engine, name, api_key=args.api_key)
        say(f"serving {name!r} on http://{args.host}:{args.port}/v1 (Ctrl-C or SIGTERM stops)")
        server = uvicorn.Server(uvicorn.Config(app, log_level=args.log_level))
        # uvicorn handles SIGINT/SIGTERM itself (stop accepting, finish open responses) and
        # then re-raises the signal with the handlers it found; these make that re-raise a
        # no-op, so the engine still drains and flushes below instead of the process dying.
        previous = {sig: signal.signal(sig, _ignore) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            server.run(sockets=[sock])
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)  # a second Ctrl-C now interrupts the drain
            flush = " and writing KV to disk" if args.disk_dir else ""
            say(f"draining in-flight requests{flush}")
            engine.close(drain=True)
    finally:
        sock.close()
    stats = engine.stats()
    say(
        f"stopped after {stats.requests_finished} requests; {stats.reused_tokens} of "
        f"{stats.prompt_tokens} prompt tokens reused"
    )
    return 0


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
