"""Transparent huge pages for torch's CPU buffers: weights, the KV cache and activations.

Torch's CPU allocator (c10's ``alloc_cpu``) backs every buffer of 2 MiB or more with
transparent huge pages (page-aligned, ``madvise(MADV_HUGEPAGE)``) when the environment
variable ``THP_MEM_ALLOC_ENABLE`` is 1, and the kernel honours that where
``/sys/kernel/mm/transparent_hugepage/enabled`` is ``always`` or ``madvise``. One 2 MiB page
then maps what 512 base pages did: a stream over the weights or the KV misses the TLB 512
times less often, and a fresh buffer faults once per 2 MiB instead of once per 4 KiB (~1.3
us a 4 KiB fault from one thread).

Measured on the 2-core AMD EPYC (torch 2.13.0+cpu, kernel mode ``madvise``; see
docs/benchmarks.md, "peers"): a 1 GiB ``torch.sum`` reads 57-58 GiB/s against 51-55, and
the offline 16 x 512 -> 64 workload took 12.4-12.9 s against 13.5-15.5 s in fresh
processes alternating by hand.

Torch reads the variable once, at the process's first CPU allocation, so it must be set
before that: ``kvtier``'s command line sets it first thing, and ``Engine.from_pretrained``
before it loads weights (too late, and harmless, where the process has already allocated).
A user who sets the variable keeps their value: ``THP_MEM_ALLOC_ENABLE=0`` opts out.
"""

from __future__ import annotations

import os

VARIABLE = "THP_MEM_ALLOC_ENABLE"


def request_huge_pages() -> None:
    """Ask torch's CPU allocator for huge pages: sets ``THP_MEM_ALLOC_ENABLE=1`` in
    ``os.environ`` unless it is already set. Effective only before the process's first
    CPU allocation (see the module docstring); not thread-safe (the environment is
    process-wide)."""
    os.environ.setdefault(VARIABLE, "1")
