"""Prompt KV reused after ``kill -9``: write-through vs write-back (``kvtier bench crash``).

For each write policy: start ``kvtier serve`` on a fresh disk directory, send distinct
prompts (no shared prefix, so every reused token comes from disk), wait ``--settle-s``,
start a streamed completion and ``SIGKILL`` the server once its first token came (noting
the bytes ``/metrics`` said the disk tier held just before), start it again on the same
directory, check it holds at least those bytes, and send the prompts again.
The figure is the fraction of cacheable prompt tokens (all but the last of each prompt)
that the restarted server reports as ``usage.prompt_tokens_details.cached_tokens``; the
completions must be identical to the first run's. The disk is real (the local
filesystem), fsync on (``kvtier serve``'s default).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import random
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kvbench.common import base_parser, finish, header
from kvbench.serve_client import by_label, completion_request, scrape_metrics
from kvbench.server_process import Server, ServerConfig

POLICIES = ("write_through", "write_back")
WORDS = [
    "harbour",
    "lantern",
    "tide",
    "gull",
    "rope",
    "anchor",
    "storm",
    "sail",
    "keel",
    "mast",
    "reef",
    "shore",
    "wave",
    "salt",
    "net",
    "cliff",
    "beacon",
    "island",
    "current",
    "drift",
    "compass",
    "chart",
    "deck",
    "hull",
    "oar",
    "pier",
    "brine",
    "fog",
]


def prompts(count: int, words: int, seed: int) -> list[str]:
    """``count`` distinct prompts of ``words`` words each, sharing no leading chunk."""
    rng = random.Random(seed)
    return [f"Log {i}: " + " ".join(rng.choice(WORDS) for _ in range(words)) for i in range(count)]


def served_model(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=10) as reply:
        return str(json.loads(reply.read())["data"][0]["id"])


def complete(port: int, prompt: str, max_tokens: int) -> dict[str, Any]:
    """One greedy completion: its text and usage."""
    model = served_model(port)
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    with urllib.request.urlopen(completion_request(port, body), timeout=300) as reply:
        answer = json.loads(reply.read())
    usage = answer["usage"]
    return {
        "text": answer["choices"][0]["text"],
        "prompt_tokens": usage["prompt_tokens"],
        "cached_tokens": usage.get("prompt_tokens_details", {}).get("cached_tokens", 0),
    }


def run_policy(
    model: str | None,
    workdir: Path,
    policy: str,
    texts: list[str],
    settle_s: float = 2.5,
    max_tokens: int = 8,
    chunk_tokens: int = 16,
) -> dict[str, Any]:
    """Serve ``texts``, wait ``settle_s``, kill -9, restart, serve them again."""
    # kvtier serve's defaults, with a disk tier and this policy; a restart is a new process
    # on the same configuration, so on the same disk folder.
    config = ServerConfig(
        name=policy,
        device_budget_mb=128,
        max_batch_size=8,
        host_mb=1024,
        chunk_tokens=chunk_tokens,
        max_queued=64,
        disk_mb=32 * 1024,
    )

    def start() -> Server:
        server = Server(config, workdir, model, timeout_s=180)
        server.command += ["--write-policy", policy]
        server.start()
        return server

    first_server = start()
    try:
        first = [complete(first_server.port, text, max_tokens) for text in texts]
        time.sleep(settle_s)  # everything sealed is now older than settle_s
        # Mid-stream: a long generation is streaming when the server is killed; what the
        # server reported held on disk just before is what must be found again.
        with stream_started(first_server.port, texts[0] + " And then", 256):
            durable = disk_bytes(first_server.port)
            first_server.kill()  # SIGKILL
    finally:
        first_server.kill()
    second_server = start()
    try:
        found = disk_bytes(second_server.port)
        start_s = time.perf_counter()
        again = [complete(second_server.port, text, max_tokens) for text in texts]
        resend_s = time.perf_counter() - start_s
    finally:
        second_server.stop()
    # At most every prompt token but the last can be reused (whole chunks, then the pages
    # of a partial one); the whole chunks are what write-through made durable.
    cacheable = sum(r["prompt_tokens"] - 1 for r in first)
    sealed = sum(chunk_tokens * ((r["prompt_tokens"] - 1) // chunk_tokens) for r in first)
    cached = sum(r["cached_tokens"] for r in again)
    return {
        "policy": policy,
        "prompts": len(texts),
        "prompt_tokens": sum(r["prompt_tokens"] for r in first),
        "cacheable_tokens": cacheable,
        "sealed_chunk_tokens": sealed,
        "cached_tokens_after_kill": cached,
        "reused_fraction": cached / cacheable if cacheable else 0.0,
        "outputs_identical": [r["text"] for r in first] == [r["text"] for r in again],
        "disk_bytes_reported_before_kill": durable,
        "disk_bytes_found_after_restart": found,
        "durable_found_again": found >= durable,
        "resend_s": resend_s,
    }


def disk_bytes(port: int) -> float:
    """The bytes the server's ``/metrics`` says its disk tier holds."""
    return by_label(scrape_metrics(port), "kvtier_tier_used_bytes").get("disk", 0.0)


@contextlib.contextmanager
def stream_started(port: int, prompt: str, max_tokens: int) -> Iterator[None]:
    """A streamed completion of ``prompt``, open (its first token received) for the body."""
    body = {
        "model": served_model(port),
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with urllib.request.urlopen(completion_request(port, body), timeout=300) as reply:
        for line in reply:
            if line.startswith(b"data: {"):
                break  # a token came: the stream is under way
        try:
            yield
        finally:
            with contextlib.suppress(OSError, http.client.HTTPException):
                reply.read()  # the server is gone: the stream ends without [DONE]


def tiny_model_folder(folder: Path) -> str:
    """A tiny random-weight llama with the embedded model's tokenizer, saved in ``folder``."""
    from transformers import AutoTokenizer

    from kvtier.models import converted_folder, embedded_gguf_path, load_model, random_model

    source = converted_folder(embedded_gguf_path())
    if (source / "tokenizer.json").is_file():
        tokenizer = AutoTokenizer.from_pretrained(str(source), local_files_only=True)
    else:
        tokenizer = load_model().tokenizer
    random_model("llama", seed=0, vocab_size=len(tokenizer)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def main(argv: list[str] | None = None) -> int:
    parser = base_parser("crash", __doc__)
    parser.add_argument(
        "--model", default=None, help="model folder (default: a tiny random llama, built here)"
    )
    parser.sized("--prompts", 16, 4, "distinct prompts", type=int)
    parser.sized("--words", 200, 80, "words per prompt", type=int)
    parser.add_argument("--settle-s", type=float, default=2.5, help="wait before the kill")
    parser.add_argument("--chunk-tokens", type=int, default=16)
    parser.add_argument("--dir", type=Path, default=None, help="where the disk tiers write")
    args = parser.parse(argv)
    count, words = args.prompts, args.words
    texts = prompts(count, words, args.seed)
    info = header({"host<->disk": "real (local disk, fsync on)"})
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="kvtier-crash-") as tmp:
        workdir = Path(tmp)
        model = args.model or tiny_model_folder(workdir / "tiny")
        print(
            f"model: {args.model or 'tiny random llama'}; {count} prompts of {words} words, "
            f"chunk {args.chunk_tokens} tokens; kill -9 {args.settle_s} s after the last reply"
        )
        results = {p: run_policy(model, workdir, p, texts, args.settle_s, 8, args.chunk_tokens)
                   for p in POLICIES}  # fmt: skip
    print(f"{'policy':<15}{'cacheable':>10}{'reused':>8}{'fraction':>10}{'resend s':>10}  outputs")
    for p, r in results.items():
        print(
            f"{p:<15}{r['cacheable_tokens']:>10}{r['cached_tokens_after_kill']:>8}"
            f"{r['reused_fraction']:>10.1%}{r['resend_s']:>10.2f}  "
            f"{'same' if r['outputs_identical'] else 'DIFFERENT'}"
        )
    summary = {f"reused_fraction_{p}": r["reused_fraction"] for p, r in results.items()}
    summary["outputs_identical"] = all(r["outputs_identical"] for r in results.values())
    config = {"prompts": count, "words": words, "settle_s": args.settle_s}
    finish(
        args.json,
        {"summary": summary, "policies": results, "config": config},
        info,
        f"summary: after kill -9, {summary['reused_fraction_write_through']:.1%} of cacheable "
        f"prompt tokens reused with write_through vs "
        f"{summary['reused_fraction_write_back']:.1%} with write_back; outputs identical "
        f"{summary['outputs_identical']}",
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
