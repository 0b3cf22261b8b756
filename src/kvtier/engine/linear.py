"""The CPU runner's projections: ``Linear`` (one weight, its oneDNN-packed copy, and the
panel copy kvtier's ``linear_panels`` kernel reads for the few-row case), ``make_linear``
and ``rows_kernel_max``, which times ``linear_panels`` against oneDNN on a model's own
weights.

``Linear`` is immutable and its call only reads its weights (safe from any thread);
``MEASURED_ROWS`` is written by the thread building a ``LlamaModel``.
"""

from __future__ import annotations

import dataclasses
import time
import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from kvtier.engine.weight_codes import find_codes, pack_code_panels, weight_codes_on

ROWS_KERNEL_MAX = 64
"""Most rows ``Linear`` may give kvtier's ``linear_panels`` kernel (oneDNN above); at start
``LlamaModel`` keeps it only up to the row count where it measures faster here."""

CODES_ROWS_MAX = 8
"""Most rows ``Linear`` multiplies on its code panels (its float32 panels above). Per-step
alternation in one engine on SmolLM2-135M (2-core AMD EPYC, Zen 4, 2026-12-07), code
panels against float32 panels: 1 row 8.3 / 8.5 / 8.8 against 18.0 / 18.5 / 18.5 ms, 4 rows
14.2 / 14.9 against 21.1 / 22.0, but 16 rows 56.8 / 56.7 / 59.1 against 52.6 / 53.8 / 54.5
(past one 8-row tile the widening is paid per tile, or per line in a buffer, while the
float32 tiles share one read)."""

CODES_ROWS_MAX_BF16 = 4
"""Most rows ``Linear`` multiplies on its bf16 code panels (bf16 mode; its bf16 panels
above). The 121 projections of SmolLM2-135M (2-core AMD EPYC, best of 6 in one process),
bf16 code panels against bf16 panels: 1 row 5.8 against 9.6 ms, 4 rows 9.3 against 11.7, 8
rows 13.7 against 12.9, 16 rows 23.4 against 18.7 (a tile takes 4 rows, and each widens the
codes again; tiles of 8 rows taking the 3 panels one at a time measured 13.5 against 12.3
at 8 rows and 18.4 against 15.3 at 16, and were not kept)."""

ROWS_MEASURED = (1, 2, 4, 8, 16, 32, 64)
"""The row counts ``rows_kernel_max`` times (a decode batch's sizes)."""


@dataclass(frozen=True)
class Linear:
    """One projection ``[out, in]``: on the CPU its oneDNN-packed copy ``pack`` and, where
    kvtier's kernels are built, its panel copy ``panels`` (``kvtier_cpu.pack_panels``);
    ``weight`` (the plain ``[out, in]`` as ``F.linear`` takes it) only where neither is.

    oneDNN's matmul on a packed weight measured 1.3-3x faster than ``F.linear`` (MKL) on
    this model's projections on the 2-core AMD EPYC, at every row count from 1 to 1,024
    (docs/benchmarks.md, "the runner's matmuls"), so the CPU runner packs every weight once
    at start. kvtier's ``linear_panels`` reads each panel block once per call and keeps a
    tile of 8 rows x 48 outputs in registers: over this model's 121 projections it measured
    0.55 (1 row), 0.62 (8), 0.86 (16) and 0.88 (64) of oneDNN's time (2-core AMD EPYC,
    interleaved, a noisy machine); other machines may differ, so ``LlamaModel`` times both
    at start and keeps the kernel only up to ``rows_max`` rows where it wins.
    """

    weight: torch.Tensor | None
    bias: torch.Tensor | None
    pack: torch.Tensor | None
    out_features: int
    in_features: int
    panels: torch.Tensor | None = None  # [ceil(out / 16), in, 16]; bf16: [.., ceil(in / 2), 16, 2]
    codes: torch.Tensor | None = None
    """Where the float32 weight has exact low-bit codes (a GGUF model's): its code panels
    (``weight_codes``; uint8, 5 or 9 bits a weight), which ``linear_panels`` multiplies
    bit for bit as the float32 ``panels``, for up to ``CODES_ROWS_MAX`` rows. With
    ``matmul_dtype`` set: the bf16 code panels, x rounded to bf16 times the exact weight
    (not the rounded one ``panels`` and ``pack`` hold), for up to ``CODES_ROWS_MAX_BF16``."""
    kernels: Any | None = None  # kvtier's CPU kernels, for up to ``rows_max`` rows
    rows_max: int = ROWS_KERNEL_MAX
    matmul_dtype: torch.dtype | None = None
    """Set (``bfloat16``): ``pack``, ``panels`` and ``bias`` hold the weight in that dtype
    (``panels`` in pairs of k, AMX's layout). Both ``linear_panels`` (up to ``rows_max``
    rows; on AMX tiles where the CPU has them) and oneDNN (above) round ``x`` to it and
    accumulate in float32; ``x`` may come already rounded."""

    @property
    def codes_rows_max(self) -> int:
        """The most rows ``codes`` take (0 without codes)."""
        if self.codes is None:
            return 0
        return CODES_ROWS_MAX if self.matmul_dtype is None else CODES_ROWS_MAX_BF16

    def __call__(self, x: torch.Tensor, low_out: bool = False) -> torch.Tensor:
        """``x [N, in]`` (float32; or ``matmul_dtype`` where it is set) → ``[N, out]``
        float32; with ``low_out``, oneDNN's product stays in ``matmul_dtype`` (the rows
        ``linear_panels`` takes still come back float32)."""
        rows = x.shape[0]
        if self.kernels is not None and rows <= self.rows_max and x.is_contiguous():
            x = x.float()  # a rounded x widens exactly
            coded = self.codes is not None and rows <= self.codes_rows_max
            panels = self.codes if coded else self.panels
            return self.kernels.linear_panels(x, panels, self.bias, self.out_features)
        if self.pack is not None:
            low = self.matmul_dtype  # set: the pack's dtype, which the input takes too
            xin = x if low is None else x.to(low)
            out = torch.ops.mkldnn._linear_pointwise(xin, self.pack, self.bias, "none", [], "")
            return out if low is None or low_out else out.float()
        assert self.weight is not None
        return F.linear(x, self.weight, self.bias)


MEASURED_ROWS: weakref.WeakKeyDictionary[Any, dict[int, int]] = weakref.WeakKeyDictionary()
"""``rows_kernel_max`` per model and torch thread count, measured once in a process."""


def rows_kernel_max(linears: list[Linear], blocks: int = 2, passes: int = 1) -> int:
    """The most rows (0 or one of ``ROWS_MEASURED``) up to which ``linear_panels`` beat
    oneDNN at every count measured, timed through all of ``linears`` (so the weights come
    from memory, as in a step) at the current thread count; 0 where either is missing.

    The two take turns in ``blocks``, each a warm-up pass then ``passes`` timed ones, and
    keep their fastest: a burst of load from elsewhere slows both rather than deciding for
    one, and neither is timed just after the other. (On the first thread, oneDNN's OpenMP
    team spins about 6 ms after its last region, on the core kvtier's pool needs: 60
    projections on one row took 11.5 ms after a pass of ``linear_panels`` and 17.5-19 ms
    just after a oneDNN pass.)"""
    usable = [x for x in linears if x.panels is not None and x.pack is not None]
    if not usable or len(usable) < len(linears):
        return ROWS_KERNEL_MAX if usable else 0
    best = 0
    gen = torch.Generator().manual_seed(0)
    for rows in ROWS_MEASURED:
        inputs = [torch.randn(rows, lin.in_features, generator=gen) for lin in usable]
        kinds = [
            [dataclasses.replace(lin, rows_max=limit) for lin in usable]
            for limit in (ROWS_KERNEL_MAX, 0)  # linear_panels, oneDNN
        ]
        fastest = [float("inf"), float("inf")]
        for _ in range(blocks):
            for kind, chosen in enumerate(kinds):
                for timed in range(passes + 1):
                    start = time.perf_counter()
                    for lin, x in zip(chosen, inputs, strict=True):
                        lin(x)
                    if timed:
                        fastest[kind] = min(fastest[kind], time.perf_counter() - start)
        if fastest[0] >= fastest[1]:
            break
        best = rows
    return best


def _onednn_pack(weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's packed copy of a CPU weight ``[out, in]``; None where torch has no oneDNN
    (or the weight is not on the CPU, or not float32/bfloat16)."""
    if (
        weight.device.type != "cpu"
        or weight.dtype not in (torch.float32, torch.bfloat16)
        or not torch.backends.mkldnn.is_available()
        or not hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    ):
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _PACK_ROWS)


_PACK_ROWS = 16
"""The row count oneDNN packs the weights for; any count runs (16 measured best or equal
from 1 to 1,024 rows)."""


def make_linear(
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    ops: Any | None,
    matmul_dtype: torch.dtype | None = None,
) -> Linear:
    """The projection of ``weight``; ``ops``: kvtier's CPU kernels (float32 CPU) or None.

    With ``ops``, a float32 weight with exact low-bit codes (``weight_codes.find_codes``)
    gets code panels too, unless ``KVTIER_WEIGHT_CODES=0``; with ``matmul_dtype`` set, the
    bf16 code panels (x rounded to bf16 times the exact weight).

    ``matmul_dtype`` (``bfloat16``): keep the weight in that dtype (half the bytes a step
    reads) and multiply on oneDNN (input rounded too, float32 accumulation; twice the FMA
    rate where the CPU has AVX-512 BF16) or, for few rows, ``linear_panels`` (float32
    input); the plain projection where oneDNN cannot pack.
    """
    weight = weight.detach().contiguous()
    cpu_ops = ops if weight.device.type == "cpu" else None
    found = find_codes(weight) if cpu_ops is not None and weight_codes_on() else None
    pack, low = None, None
    if matmul_dtype is not None and matmul_dtype != weight.dtype:
        rounded = weight.to(matmul_dtype)
        pack = _onednn_pack(rounded)
        if pack is not None:  # else the plain projection
            low, weight = matmul_dtype, rounded
            bias = None if bias is None else bias.detach().to(low)
    pack = pack if pack is not None else _onednn_pack(weight)
    panels = cpu_ops.pack_panels(weight) if cpu_ops is not None else None
    codes = None if found is None else pack_code_panels(found, bf16=low is not None)
    out_features, in_features = weight.shape
    kernels = ops if panels is not None else None
    plain = weight if pack is None else None  # F.linear's, above ``rows_max`` rows
    return Linear(
        plain, bias, pack, out_features, in_features, panels, codes, kernels, matmul_dtype=low
    )
