"""``kvtier calibrate``: the rates kvtier's cost model needs, measured here for one model.

FlexGen's cost model warns that rates taken from single-op microbenchmarks or the internet
"will not be accurate"; so every rate here is measured through the code path that will use
it, on the machine that runs it:

- ``link``: the device⇄host link (``kvtier.transfer.Link`` copying a chunk-sized buffer
  per step) each way alone and both ways at once. Without an accelerator the "device" is
  host memory, so the link is a memcpy (``kind`` says which).
- ``host_attention_gbps``: one decode query over host-resident KV of every layer, bytes of
  K and V read per second, per thread count: torch's kernel (``attend_flat``, what a
  host-side segment runs today) and kvtier's ``decode_attend`` where it is built.
- ``disk``: sequential write (``fdatasync``) and read of a scratch file through the disk
  tier's I/O helpers, with ``O_DIRECT`` where the filesystem takes it (``direct``).
- ``compute``: the model's prefill seconds for prompts of several lengths and its decode
  milliseconds per token at several contexts, through the engine (``kvtier.engine``,
  batch 1, all KV resident), each with a least-squares fit: prefill ``s = a·n + b·n²``
  (matmuls grow with the tokens, attention with their square), decode ``ms = c + d·n``.
- ``shared_tier``: null until a shared tier is configured (the Redis tier is not built).

``calibrate`` returns the profile (a JSON-ready dict) and ``save_profile`` writes it to
``<kvtier cache>/profiles/<machine>-<model>.json``; ``load_profile`` finds the one that
matches this machine (``machine_identity``: CPU model, cores, memory, accelerator, torch)
and a model identity (``kvtier.models.model_identity``). Nothing here mutates shared
state; measurements run on the calling thread (the link's worker thread for the link),
with torch's thread count restored afterwards.
"""

from kvtier.calibrate.measure import (
    fit,
    measure_compute,
    measure_disk,
    measure_host_attention,
    measure_link,
)
from kvtier.calibrate.profile import (
    PROFILE_VERSION,
    load_profile,
    machine_identity,
    profile_path,
    save_profile,
)
from kvtier.calibrate.run import Settings, calibrate, main, report

__all__ = [
    "PROFILE_VERSION",
    "Settings",
    "calibrate",
    "fit",
    "load_profile",
    "machine_identity",
    "main",
    "measure_compute",
    "measure_disk",
    "measure_host_attention",
    "measure_link",
    "profile_path",
    "report",
    "save_profile",
]
