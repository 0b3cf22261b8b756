"""``kvtier calibrate``: the rates kvtier's cost model needs, measured here for one model.

FlexGen's cost model warns that rates taken from single-op microbenchmarks or the internet
"will not be accurate"; so every rate here is measured through the code path that will use
it, on the machine that runs it:

- ``link``: the device⇄host link (``kvtier.transfer.Link`` copying a chunk-sized buffer
  per step) each way alone and both ways at once. Without an accelerator the "device" is
  host memory, so the link is a memcpy (``kind`` says which).
- ``attention``: one decode query over KV of every layer, bytes of K and V read per
  second: in the host pool per thread count (``host``: torch's kernel over the slots
  gathered, and kvtier's ``attend_slots`` in place where it is built), and in the device
  pool (``device``: kvtier's ``decode_attend`` on a CPU device, torch's kernel on another).
- ``disk``: sequential write (``fdatasync``) and read of a scratch file through the disk
  tier's I/O helpers, with ``O_DIRECT`` where the filesystem takes it (``direct``).
- ``compute``: the model's prefill seconds for prompts of several lengths and its decode
  milliseconds per token at several contexts, through the engine (``kvtier.engine``,
  batch 1, all KV resident), each with a least-squares fit: prefill ``s = a·n + b·n²``
  (matmuls grow with the tokens, attention with their square), decode ``ms = c + d·n``;
  and ``decode_batch``: the decode step with ``B`` sequences together, ``ms = e + f·B``.
- ``remote`` (with ``--remote URL``): the shared tier's write and read GB/s through
  ``kvtier.tiers.remote.RemoteTier`` (chunk-sized values, under a scratch prefix).

``calibrate`` returns the profile (a JSON-ready dict); ``kvtier.profiles`` saves it to
``<kvtier cache>/profiles/<machine>-<model>.json``, finds the one that matches this machine
and model, and reads the cost model's rates from it (the engine and the transformers cache
read profiles there, below this package, which measures through the engine; a profile
missing at start is measured by ``ensure_profile``). Nothing here mutates shared
state; measurements run on the calling thread (the link's worker thread for the link),
with torch's thread count restored afterwards.
"""

from kvtier.calibrate.measure import (
    fit,
    measure_attention,
    measure_batch_decode,
    measure_compute,
    measure_disk,
    measure_link,
    measure_remote,
)
from kvtier.calibrate.run import (
    Settings,
    calibrate,
    calibrate_model,
    ensure_profile,
    main,
    report,
)

__all__ = [
    "Settings",
    "calibrate",
    "calibrate_model",
    "ensure_profile",
    "fit",
    "main",
    "measure_attention",
    "measure_batch_decode",
    "measure_compute",
    "measure_disk",
    "measure_link",
    "measure_remote",
    "report",
]
