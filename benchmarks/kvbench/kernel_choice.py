"""Benchmark ``kernel_choice``: which matmul and pointwise kernels should kvtier's runner use?

Question: on this machine, how fast is every projection of the embedded model (each
layer's fused q/k/v, o, fused gate/up and down, plus the head) at the row counts a step
has — one decoding sequence (1), a decode batch (4, 16), a prefill piece (256, 1,024) —
through

- ``F.linear`` on the ``[out, in]`` weights (transformers' path: MKL on the CPU),
- ``x @ W`` on ``[in, out]`` copies (the runner's one-row path before oneDNN),
- oneDNN's matmul on packed weights (``kvtier.engine.linear.Linear``'s path from 3 rows),
- kvtier's ``linear_panels`` CPU kernel on the weights in panels of 16 outputs
  (``kvtier.native``; the runner's path for a decode batch's few rows), where it is built,

and do the runner's pointwise stages (RMSNorm, RoPE on q and k, SiLU·mul, residual add
and norm) gain from ``torch.compile`` (inductor, dynamic shapes) over eager? Every case
runs interleaved, ``--repeats`` times, on the embedded model's real weights; figures are
medians. The bound of a one-row step is the weight bytes ÷ the streaming read bandwidth
(best of 5 sums of a 512 MiB tensor).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

from kvbench.common import base_parser, finish, header, interleave, median, read_gbps, timed
from kvtier import native
from kvtier.engine.linear import Linear
from kvtier.engine.llama import LlamaModel
from kvtier.models import load_model


def projections(model: Any, llama: LlamaModel) -> list[tuple[torch.Tensor, Linear]]:
    """Every projection of a step: (its ``[out, in]`` weight, the runner's packed one)."""
    out: list[tuple[torch.Tensor, Linear]] = []
    for layer, fused in zip(model.model.layers, llama.layers, strict=True):
        attn, mlp = layer.self_attn, layer.mlp
        qkv = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
        gate_up = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])
        out += [(qkv, fused.qkv), (attn.o_proj.weight, fused.o)]
        out += [(gate_up, fused.gate_up), (mlp.down_proj.weight, fused.down)]
    out.append((model.lm_head.weight, llama.lm_head))
    return out


def matmul_cases(
    weights: list[tuple[torch.Tensor, Linear]], rows: int
) -> dict[str, Callable[[int], float]]:
    """The ways to run every projection once on ``rows`` rows (kvtier's ``linear_panels``
    where its CPU kernels are built); each returns seconds."""
    gen = torch.Generator().manual_seed(rows)
    inputs = {w.shape[1]: torch.randn(rows, w.shape[1], generator=gen) for w, _ in weights}
    transposed = [w.t().contiguous() for w, _ in weights]

    def linear() -> None:
        for w, _ in weights:
            F.linear(inputs[w.shape[1]], w)

    def in_out() -> None:
        for (w, _), wt in zip(weights, transposed, strict=True):
            inputs[w.shape[1]] @ wt

    def onednn() -> None:
        for w, packed in weights:
            x = inputs[w.shape[1]]
            torch.ops.mkldnn._linear_pointwise(x, packed.pack, packed.bias, "none", [], "")

    runs = {"F.linear": linear, "x @ W[in,out]": in_out, "onednn": onednn}
    ops = native.ops()
    if ops is not None and all(packed.panels is not None for _, packed in weights):

        def panels_kernel() -> None:
            for w, packed in weights:
                ops.linear_panels(inputs[w.shape[1]], packed.panels, None, packed.out_features)

        runs["kvtier linear_panels"] = panels_kernel
    return {name: partial(_seconds, fn) for name, fn in runs.items()}


def _seconds(fn: Callable[[], object], _round: int) -> float:
    """Seconds ``fn`` takes (a case for ``interleave``)."""
    return timed(fn)


def pointwise(
    llama: LlamaModel, intermediate: int, rows: int, compiled: bool
) -> Callable[[int], float]:
    """One layer's pointwise stages on ``rows`` tokens (eager or compiled); seconds."""
    hq, hkv, dim = llama.num_heads, llama.num_kv_heads, llama.head_dim
    layer = llama.layers[0]
    gen = torch.Generator().manual_seed(rows)
    hidden = llama.final_norm.shape[0]
    h = torch.randn(rows, hidden, generator=gen)
    delta = torch.randn(rows, hidden, generator=gen)
    qkv = torch.randn(rows, (hq + 2 * hkv) * dim, generator=gen)
    gate_up = torch.randn(rows, 2 * intermediate, generator=gen)
    cos = torch.randn(1, 1, rows, dim, generator=gen)
    sin = torch.randn(1, 1, rows, dim, generator=gen)

    def stages(
        h: torch.Tensor, delta: torch.Tensor, qkv: torch.Tensor, gate_up: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        x = llama._norm(h, layer.input_norm)
        q, k, v = qkv.split([hq * dim, hkv * dim, hkv * dim], dim=-1)
        q = llama._rope(q.view(1, rows, hq, dim).transpose(1, 2), cos, sin)
        k = llama._rope(k.view(1, rows, hkv, dim).transpose(1, 2), cos, sin)
        h = h + delta
        y = llama._norm(h, layer.post_norm)
        gate, up = gate_up.chunk(2, dim=-1)
        return x, q, k, v, y, llama.act(gate) * up

    fn = torch.compile(stages, dynamic=True) if compiled else stages

    def twenty() -> None:
        for _ in range(20):
            fn(h, delta, qkv, gate_up)

    return lambda _: timed(twenty) / 20


def run(args: Any) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    model = load_model().model
    llama = LlamaModel(model)
    weights = projections(model, llama)
    nbytes = sum(w.numel() * w.element_size() for w, _ in weights)
    flops_per_row = 2 * sum(w.numel() for w, _ in weights)
    matmuls: dict[str, dict[str, float]] = {}
    for rows in args.rows:
        cases = matmul_cases(weights, rows)
        for case in cases.values():  # warm
            case(0)
        times = interleave(cases, args.repeats)
        matmuls[str(rows)] = {name: median(values) * 1e3 for name, values in times.items()}
    point: dict[str, dict[str, float]] = {}
    for rows in args.pointwise_rows:
        width = int(model.config.intermediate_size)
        eager = pointwise(llama, width, rows, compiled=False)
        compiled = pointwise(llama, width, rows, compiled=True)
        first_s = timed(partial(compiled, 0))  # it compiles (or loads from inductor's cache)
        eager(0)
        times_pw = interleave({"eager": eager, "compiled": compiled}, args.repeats)
        point[str(rows)] = {
            "eager_us_per_layer": median(times_pw["eager"]) * 1e6,
            "compiled_us_per_layer": median(times_pw["compiled"]) * 1e6,
            "first_call_s": first_s,
        }
    gbps = read_gbps(512 * 2**20, args.threads)
    one = matmuls.get("1", {})
    return {
        "weight_bytes": nbytes,
        "read_gbps": gbps,
        "bound_one_row_ms": nbytes / gbps / 1e6,
        "matmul_ms": matmuls,
        "matmul_gbps": {
            rows: {name: nbytes / ms / 1e6 for name, ms in cases.items()}
            for rows, cases in matmuls.items()
        },
        "matmul_gflops": {
            rows: {name: flops_per_row * int(rows) / ms / 1e6 for name, ms in cases.items()}
            for rows, cases in matmuls.items()
        },
        "pointwise": point,
        "summary": {
            "onednn_vs_linear_1_row": one.get("F.linear", 0) / one["onednn"] if one else None,
            "onednn_one_row_vs_bound": (nbytes / gbps / 1e6) / one["onednn"] if one else None,
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = base_parser("kernel_choice", __doc__)
    parser.add_argument("--threads", type=int, default=2, minimum=1, help="torch threads")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved runs of each case")
    args = parser.parse(argv)
    args.rows = [1, 16, 256] if args.quick else [1, 4, 16, 64, 256, 1024]
    args.pointwise_rows = [1, 256] if args.quick else [1, 16, 256]
    if args.quick:
        args.repeats = min(args.repeats, 2)
    info = header()
    result = run(args)
    result["args"] = {k: v for k, v in vars(args).items() if k != "json"}
    print(
        f"{'rows':>6}" + "".join(f"{name:>22}" for name in next(iter(result["matmul_ms"].values())))
    )
    for rows, cases in result["matmul_ms"].items():
        gflops = result["matmul_gflops"][rows]
        cells = "".join(f"{ms:>10.1f} ms {gflops[n]:>5.0f} GF" for n, ms in cases.items())
        print(f"{rows:>6}{cells}")
    print(
        f"one-row bound: {result['weight_bytes'] / 1e6:.0f} MB of weights / "
        f"{result['read_gbps']:.1f} GB/s = {result['bound_one_row_ms']:.1f} ms"
    )
    for rows, p in result["pointwise"].items():
        print(
            f"pointwise, {rows} rows: eager {p['eager_us_per_layer']:.0f} us/layer, compiled "
            f"{p['compiled_us_per_layer']:.0f} us/layer (first call {p['first_call_s']:.1f} s)"
        )
    s = result["summary"]
    finish(
        args.json,
        result,
        info,
        f"summary: oneDNN one-row pass {s['onednn_vs_linear_1_row']:.2f}x faster than F.linear, "
        f"{s['onednn_one_row_vs_bound']:.2f} of the read bound",
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
