"""Benchmarks, one module per question; ``kvtier bench NAME`` and ``benchmarks/NAME.py``."""

from __future__ import annotations

BENCHMARKS = (
    "tiers",
    "decode",
    "reuse",
    "throughput",
    "serve",
    "multiturn",
    "tenants",
    "crash",
    "writeback",
    "peers",
    "kernel_choice",
    "profile_step",
    "librarian",
    "flood",
    "plan",
    "overlap",
    "shared",
    "faults",
    "vllm",
    "eviction",
    "codec",
)
