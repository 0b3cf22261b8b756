"""Benchmark ``codec``: what a compressed lower tier saves in bytes and time, and what it
costs in tokens.

Question: with chunks stored as ``fp8``, ``int8`` or ``int4`` instead of ``raw`` fp32, how
many bytes does a chunk take, how fast do the codecs run here, how often does the model's
greedy token change, and how much sooner does a 4K prompt reused from disk give its first
token?

Method (baseline: ``raw``, measured in the same run):

- sizes and speeds: each codec encodes and decodes a real chunk of the model's KV (the first
  chunk of a text window), GB/s of fp32 chunk bytes, median of 3 ``--repeats`` (at least
  9), with kvtier's native kernels (what the tiers run on the CPU) and with torch's ops
  (``KVTIER_NATIVE=0``, the path before them);
- quality (``kvbench.codec_quality``): ``--sequences`` windows of 512 prompt tokens and
  ``--continuation`` teacher-forced tokens, every sealed chunk round-tripped through the
  codec; greedy-token agreement and mean KL against raw, on the embedded model (text from
  the standard library's docstrings) and on two random-weight families (random ids); the
  pass-key question of ``kvtier run`` answered from ``--pass-key-documents`` round-tripped
  documents of ``--pass-key-context`` tokens (2,048: the longest at which the embedded
  model finds every key in raw; see ``codec_quality.pass_key_answers``);
- disk reuse (``kvbench.reuse``'s turns): turn 1 writes the history's chunks to a disk tier
  in the codec; each turn 2 opens a new manager on the directory (host empty) and generates
  over history + follow-up; TTFT raw over int8, interleaved, on the real disk and behind a
  link throttled to ``--disk-gbps``. The real disk is the page cache here (the files were
  just written), so a raw read is a memory copy; the throttled link models a drive instead:
  2 GB/s by default, an NVMe SSD's sequential read (PCIe 3 x4 drives give 2-3.5 GB/s).

- link-bound decode (``kvbench.codec_decode``): a ``--decode-context`` prompt decoded at a
  10 % device budget with the host tier in raw and in int8, the rest of the context
  streamed every step over a link throttled so that raw's bytes take 1.5, 4 and 10 times
  its unthrottled step; ``link_bound_decode_speedup_int8`` is raw's step over int8's at 4.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from transformers import DynamicCache

from kvbench import codec_quality as quality
from kvbench.codec_decode import KEY_FACTOR, link_bound_decode
from kvbench.common import finish, header, interleave, median
from kvbench.reuse import NEW_TOKENS, History, Turn, make_history, tiered_turn
from kvbench.setup import BenchModel, load_bench, model_parser
from kvtier import native
from kvtier.codec import CODECS, Codec
from kvtier.config import DiskConfig, HostConfig, LinkConfig, ManagerConfig
from kvtier.kv.layout import KVLayout
from kvtier.manager import KVManager
from kvtier.models import load_model
from kvtier.random_weights import random_model
from kvtier.transfer import Throttle

LOSSY = ("fp8", "int8", "int4")
FAMILIES = ("qwen2", "mistral")
PROMPT_TOKENS = 512
# Random families: small enough to run 64 windows in seconds, with peaked attention (random
# weights otherwise attend almost uniformly and hide what quantisation does to scores).
FAMILY_SHAPE: dict[str, Any] = dict(
    hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
    num_hidden_layers=4, intermediate_size=512, vocab_size=4096, max_position_embeddings=4096,
    attention_gain=8.0,
)  # fmt: skip


@contextmanager
def torch_ops() -> Iterator[None]:
    """The codecs take torch's path inside (``KVTIER_NATIVE=0``, read on every call)."""
    before = os.environ.get(native.ENV_SWITCH)
    os.environ[native.ENV_SWITCH] = "0"
    try:
        yield
    finally:
        if before is None:
            del os.environ[native.ENV_SWITCH]
        else:
            os.environ[native.ENV_SWITCH] = before


def gbps(codec: Codec, layout: KVLayout, chunk: torch.Tensor, repeats: int) -> tuple[float, float]:
    """(encode, decode) GB/s of fp32 chunk bytes, medians of ``repeats``."""
    encoded = codec.encode(chunk, layout)
    decoded = torch.empty_like(chunk)
    enc, dec = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        codec.encode_into(chunk, encoded)
        enc.append(time.perf_counter() - start)
        start = time.perf_counter()
        codec.decode_into(encoded, decoded)
        dec.append(time.perf_counter() - start)
    return layout.chunk_nbytes / median(enc) / 1e9, layout.chunk_nbytes / median(dec) / 1e9


def speeds(layout: KVLayout, chunk: torch.Tensor, repeats: int) -> dict[str, dict[str, Any]]:
    """Bytes per chunk and encode/decode GB/s (of fp32 chunk bytes) of every codec, as the
    tiers run it (native kernels where built) and on torch's ops."""
    out: dict[str, dict[str, Any]] = {}
    for name, codec in CODECS.items():
        decoded = torch.empty_like(chunk)
        codec.decode_into(codec.encode(chunk, layout), decoded)
        encode, decode = gbps(codec, layout, chunk, repeats)
        with torch_ops():
            encode_torch, decode_torch = gbps(codec, layout, chunk, repeats)
        out[name] = {
            "bytes_per_chunk": codec.encoded_nbytes(layout),
            "bytes_ratio": codec.ratio(layout),
            "encode_gbps": encode,
            "decode_gbps": decode,
            "encode_gbps_torch": encode_torch,
            "decode_gbps_torch": decode_torch,
            "max_abs_error": float((decoded - chunk).abs().max()),
        }
    return out


def first_chunk(model: Any, layout: KVLayout, ids: torch.Tensor) -> torch.Tensor:
    """The KV ``[L, 2, H, T, D]`` of the first chunk of ``ids`` ``[1, >= T]``."""
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(ids[:, : layout.chunk_tokens], cache=cache, use_cache=True)
    layers = quality.kv_layers(cache)
    return torch.stack([torch.stack([la.keys[0], la.values[0]]) for la in layers])


def quality_of(
    model: Any, layout: KVLayout, windows: torch.Tensor, batch: int
) -> dict[str, dict[str, float]]:
    lossy: dict[str, Codec] = {name: CODECS[name] for name in LOSSY}
    found = quality.measure(model, layout, windows, PROMPT_TOKENS, lossy, batch)
    return {
        name: {"token_agreement": q.token_agreement, "mean_kl": q.mean_kl, "positions": q.positions}
        for name, q in found.items()
    }


def families(args: Any, tokens: int) -> dict[str, Any]:
    """Quality on the random-weight families."""
    out: dict[str, Any] = {}
    for i, arch in enumerate(FAMILIES):
        model = random_model(arch, "tiny", seed=args.seed + i, **FAMILY_SHAPE)
        layout = KVLayout.from_model_config(model.config, torch.float32, 256)
        windows = quality.random_windows(
            int(model.config.vocab_size), args.family_sequences, tokens, args.seed + i
        )
        start = time.perf_counter()
        out[arch] = quality_of(model, layout, windows, args.batch)
        print(f"  {arch}: {_agreements(out[arch])} ({time.perf_counter() - start:.0f} s)")
    return out


def disk_manager(
    bench: BenchModel, h: History, disk: Path, codec: str, gbps: float | None
) -> KVManager:
    config = ManagerConfig(
        chunk_tokens=bench.layout.chunk_tokens,
        host=HostConfig(capacity_bytes=h.host_nbytes),
        lower_tiers=(
            DiskConfig(
                path=str(disk), capacity_bytes=2 * h.host_nbytes, codec=codec,
                link=LinkConfig(gbps=gbps),
            ),
        ),
    )  # fmt: skip
    return KVManager(bench.layout, bench.model_id, config)


def disk_reuse(
    bench: BenchModel, h: History, repeats: int, gbps: float | None, workdir: Path
) -> dict[str, Any]:
    """Turn 2's TTFT with the history on disk in ``raw`` and in ``int8`` (interleaved)."""
    dirs = {}
    for codec in ("raw", "int8"):
        dirs[codec] = workdir / f"disk-{codec}-{gbps}"
        manager = disk_manager(bench, h, dirs[codec], codec, gbps)
        tiered_turn(bench, manager, h, h.history, 1)
        manager.close(flush_host_to_disk=True)

    def turn(codec: str) -> Turn:
        manager = disk_manager(bench, h, dirs[codec], codec, gbps)
        try:
            result = tiered_turn(bench, manager, h, h.prompt, NEW_TOKENS)
            result.disk_hits = manager.stats().tiers["disk"].hits
        finally:
            manager.close()
        return result

    cases: dict[str, Callable[[int], Turn]] = {
        "raw": lambda _: turn("raw"),
        "int8": lambda _: turn("int8"),
    }
    turns = interleave(cases, repeats)
    ttft = {c: median([t.ttft_s for t in runs]) for c, runs in turns.items()}
    return {
        "ttft_s": ttft,
        "ttft_samples_s": {c: [t.ttft_s for t in runs] for c, runs in turns.items()},
        "speedup_int8": ttft["raw"] / ttft["int8"],
        "disk_hits": {c: min(t.disk_hits for t in runs) for c, runs in turns.items()},
        "reused_tokens": {c: min(t.reused_tokens for t in runs) for c, runs in turns.items()},
        "new_tokens_same_as_raw": turns["int8"][0].tokens == turns["raw"][0].tokens,
        "disk_link": "real" if gbps is None else f"throttled to {gbps} GB/s",
    }


def _agreements(found: dict[str, dict[str, float]]) -> str:
    return ", ".join(
        f"{n} {q['token_agreement']:.4f} (KL {q['mean_kl']:.2e})" for n, q in found.items()
    )


def main(argv: list[str] | None = None) -> int:
    parser = model_parser("codec", __doc__)
    parser.sized("--sequences", 64, 1, "windows of the embedded model", type=int, minimum=1)
    parser.sized("--family-sequences", 64, 2, "windows per random family", type=int, minimum=1)
    parser.sized("--continuation", 512, 256, "teacher-forced tokens per window", type=int,
                 minimum=256)  # fmt: skip
    parser.sized("--repeats", 3, 1, "timed rounds", type=int, minimum=1)
    parser.sized("--history", "4k", "1k", "disk reuse history (reuse's labels)")
    parser.sized("--pass-key-context", 2048, 768, "pass-key document tokens", type=int)
    parser.sized("--pass-key-documents", 4, 2, "pass-key documents (seeds 0..)", type=int,
                 minimum=1)  # fmt: skip
    parser.sized("--decode-context", 4096, 1024, "link-bound decode prompt tokens", type=int)
    parser.sized("--decode-tokens", 16, 6, "link-bound decode new tokens", type=int, minimum=3)
    parser.add_argument("--batch", type=int, default=8, minimum=1, help="windows per forward")
    parser.add_argument("--disk-gbps", type=float, default=2.0,
                        help="the throttled disk link (default: an NVMe SSD's read)")  # fmt: skip
    parser.add_argument("--dir", type=Path, default=None, help="where the disk tiers write")
    args = parser.parse(argv)
    if args.continuation % 256:
        raise ValueError(f"--continuation: whole chunks (256 tokens), got {args.continuation}")
    bench = load_bench(args, 8192)
    link = Throttle(args.disk_gbps, 0.0).describe()
    info = header({"host<->disk": f"real (local disk), and {link}"})
    tokens = PROMPT_TOKENS + args.continuation
    print(f"model: {bench.description}; {args.sequences} windows of {PROMPT_TOKENS} + "
          f"{args.continuation} tokens; families {', '.join(FAMILIES)}")  # fmt: skip
    if args.random_shape is not None:
        raise ValueError("--random-shape: the codec bench needs a model with a tokenizer")
    tokenizer = load_model(args.model).tokenizer
    windows = quality.text_windows(tokenizer, args.sequences, tokens)
    layout = bench.layout
    chunk = first_chunk(bench.model, layout, windows[:1])
    sizes = speeds(layout, chunk, max(3 * args.repeats, 9))  # ms each: medians of 9+
    kernels = native.status().line()
    print(f"  {kernels}")
    for name, s in sizes.items():
        print(f"  {name:<5}{s['bytes_per_chunk']:>10} B ({s['bytes_ratio']:.3f})  encode "
              f"{s['encode_gbps']:.2f} GB/s (torch {s['encode_gbps_torch']:.2f})  decode "
              f"{s['decode_gbps']:.2f} GB/s (torch {s['decode_gbps_torch']:.2f})")  # fmt: skip
    start = time.perf_counter()
    embedded = quality_of(bench.model, layout, windows, args.batch)
    print(f"  embedded: {_agreements(embedded)} ({time.perf_counter() - start:.0f} s)")
    random_families = families(args, tokens)
    found_keys = quality.pass_key_answers(
        bench.model, tokenizer, layout, {n: CODECS[n] for n in LOSSY}, args.pass_key_context,
        args.pass_key_documents,
    )  # fmt: skip
    pass_key = {n: {"answers": p.answers, "found": p.found} for n, p in found_keys.items()}
    print(f"  pass key ({args.pass_key_documents} documents of {args.pass_key_context} tokens): "
          + ", ".join(f"{n} {p.found} found" for n, p in found_keys.items()))  # fmt: skip
    workdir = Path(tempfile.mkdtemp(prefix="kvtier-bench-codec-", dir=args.dir))
    try:
        h = make_history(bench, args.history, args.seed)
        reuse = {
            "real": disk_reuse(bench, h, args.repeats, None, workdir),
            "throttled": disk_reuse(bench, h, args.repeats, args.disk_gbps, workdir),
        }
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    decode = link_bound_decode(
        bench, args.decode_context, args.decode_tokens, args.repeats, args.seed
    )
    for r in reuse.values():
        print(f"  disk reuse ({r['disk_link']}): raw {r['ttft_s']['raw']:.2f} s, int8 "
              f"{r['ttft_s']['int8']:.2f} s ({r['speedup_int8']:.2f}x)")  # fmt: skip
    summary: dict[str, Any] = {
        "int8_bytes_ratio": sizes["int8"]["bytes_ratio"],
        "int8_token_agreement": embedded["int8"]["token_agreement"],
        "fp8_token_agreement": embedded["fp8"]["token_agreement"],
        "int4_token_agreement": embedded["int4"]["token_agreement"],
        "link_bound_decode_speedup_int8": decode["speedup_int8"],
        "link_bound_decode_speedup_int8_by_factor": {
            f: d["speedup_int8"] for f, d in decode["by_factor"].items()
        },
        "disk_reuse_ttft_speedup_int8": reuse["real"]["speedup_int8"],
        "disk_reuse_ttft_speedup_int8_throttled": reuse["throttled"]["speedup_int8"],
        "pass_key_found": {n: p["found"] for n, p in pass_key.items()},
        "pass_key_documents": args.pass_key_documents,
        "int8_decode_gbps": sizes["int8"]["decode_gbps"],
        "int8_decode_gbps_torch": sizes["int8"]["decode_gbps_torch"],
    }
    for name in LOSSY:
        summary[f"{name}_mean_kl"] = embedded[name]["mean_kl"]
        summary[f"{name}_token_agreement_families_min"] = min(
            f[name]["token_agreement"] for f in random_families.values()
        )
    result = {
        "summary": summary,
        "sizes": sizes,
        "quality": {"embedded": embedded, **random_families},
        "pass_key": pass_key,
        "disk_reuse": reuse,
        "link_bound_decode": decode,
        "config": {
            "model": bench.description,
            "layout": layout.fingerprint(),
            "sequences": args.sequences,
            "family_sequences": args.family_sequences,
            "prompt_tokens": PROMPT_TOKENS,
            "continuation_tokens": args.continuation,
            "families": {a: "tiny + " + str(FAMILY_SHAPE) for a in FAMILIES},
            "history": args.history,
            "repeats": args.repeats,
            "pass_key_context": args.pass_key_context,
            "pass_key_documents": args.pass_key_documents,
            "disk_gbps_throttled": args.disk_gbps,
            "kernels": kernels,
        },
    }
    s = summary
    finish(
        args.json,
        result,
        info,
        f"summary: int8 {s['int8_bytes_ratio']:.3f} of raw's bytes; greedy agreement int8 "
        f"{s['int8_token_agreement']:.4f}, fp8 {s['fp8_token_agreement']:.4f}, int4 "
        f"{s['int4_token_agreement']:.4f}; {args.history} disk reuse TTFT "
        f"{s['disk_reuse_ttft_speedup_int8']:.2f}x (throttled to {args.disk_gbps} GB/s "
        f"{s['disk_reuse_ttft_speedup_int8_throttled']:.2f}x); pass key "
        f"{s['pass_key_found']} of {args.pass_key_documents}; link-bound decode (x{KEY_FACTOR:g}) "
        f"{s['link_bound_decode_speedup_int8']:.2f}x",
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
