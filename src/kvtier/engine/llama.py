"""kvtier's own forward for the Llama family, on the scheduler's packed batches.

Llama, Mistral, Qwen2 and Qwen3 share one shape: per layer an RMSNorm, q/k/v projections
(Qwen2: with bias; Qwen3: an RMSNorm per head on q and k), RoPE, attention, an output
projection, then an RMSNorm and a SiLU-gated MLP, each added to the residual stream. This
module runs that shape directly on a step's tokens packed in one row ``[N]``, from the
weights of the loaded transformers model (shared, not copied, except the fused ones):

- q, k and v are one matmul (their weights concatenated once at start), gate and up one;
  on the CPU every matmul runs on a oneDNN-packed copy of its weight, or for a decode
  batch's few rows on kvtier's ``linear_panels`` kernel (``Linear``);
- RoPE's cos/sin come from the model's own rotary module, tabled once over positions and
  gathered per step for every layer (``kvtier.engine.rope``);
- attention is ``kvtier.engine.step_attend.attend_layer``: the decode rows of seated
  sequences in one call per layer (``kvtier.runtime.DecodeBatch``), the other spans' K/V
  into their ``kvtier.runtime.SequenceKV`` and one ``attend_packed`` call per layer.

On a float32 CPU model with kvtier's CPU kernels (``kvtier.native``) each residual add is
fused with the next RMSNorm, RoPE runs in place on the q/k projection output and SiLU·mul is
one op (``_forward_native``); elsewhere the same steps run on torch's ops. A step whose every
row is a seated decode row can run all its layers in one call (``kvtier_cpu::decode_layers``,
its projections on ``linear_panels``: the same operators in the same order, so the same
bits, without ~15 Python calls a layer); ``kvtier.engine.decode_path`` picks it or the loop
by the step's row count, from the first steps of each size. The last layer runs its
o-projection and MLP only on the rows whose logits are wanted (its k/v on every row, for the
KV): no other row reads them, and for a prompt that is 84 % of one layer's projection FLOPs
(SmolLM2).

The arithmetic is transformers' (the same ops in the same order, fp32 norms; the kernels
differ only in summation order and in a ~1 ulp ``exp``), so greedy tokens equal its
modelling code's (tested on both paths). ``LlamaModel.supports(model)`` says whether a model
has this shape; anything else runs through transformers (``kvtier.engine.runner``).

Thread-safety: one forward at a time (the engine's worker thread); mutates only the
sequences' KV through the runtime.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvtier import native
from kvtier.engine.decode_path import DecodePath
from kvtier.engine.greedy_head import ROWS_MAX as GREEDY_ROWS_MAX
from kvtier.engine.greedy_head import GreedyHead
from kvtier.engine.layer_weights import decode_arguments, fuse_layer
from kvtier.engine.linear import MEASURED_ROWS, ROWS_KERNEL_MAX, make_linear, rows_kernel_max
from kvtier.engine.rope import RopeTable
from kvtier.engine.step_attend import attend_layer
from kvtier.runtime import DecodeBatch, SequenceKV

log = logging.getLogger(__name__)

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3")
"""Model types whose transformers modelling has exactly the shape this module runs."""


class LlamaModel:
    """The forward of a transformers Llama-family causal LM over packed spans.

    Args:
        model: a loaded ``LlamaForCausalLM`` (or Mistral, Qwen2, Qwen3) in eval mode.
        matmul_dtype: None multiplies in the weights' dtype (exact against transformers);
            ``bfloat16`` runs every projection in bf16 on oneDNN or AMX and long prefill
            passes' attention in bf16: on kvtier's AMX kernel over the engine's bf16 KV
            (``EngineConfig.matmul_dtype``), else on torch's bf16 flash kernel (float32
            accumulation; the residual stream stays in the model's dtype): faster, and
            the tokens drift from transformers' (``kvtier bench peers --bf16``).

    Raises:
        ValueError: the model does not have the shape (``supports`` says why not).
    """

    def __init__(self, model: Any, matmul_dtype: torch.dtype | None = None) -> None:
        reason = self.why_not(model)
        if reason is not None:
            raise ValueError(f"{model.config.model_type}: {reason}")
        config = model.config
        base = model.model
        self.num_heads = int(config.num_attention_heads)
        self.num_kv_heads = int(config.num_key_value_heads or self.num_heads)
        self.head_dim = int(
            getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        )
        self.eps = float(config.rms_norm_eps)
        self.embed = base.embed_tokens  # the module: [V, H] lookup
        self.final_norm = base.norm.weight
        weight = model.lm_head.weight
        cpu32 = weight.is_cpu and weight.dtype == torch.float32
        # kvtier's CPU kernels (float32), or None: torch's ops
        self.ops = native.ops() if cpu32 else None
        self.matmul_dtype = matmul_dtype
        self.lm_head = make_linear(weight, None, self.ops, matmul_dtype)  # [V, H]
        self.rope = RopeTable(base.rotary_emb)
        self.scale = float(base.layers[0].self_attn.scaling)
        self.act: Callable[[torch.Tensor], torch.Tensor] = base.layers[0].mlp.act_fn
        layers = [fuse_layer(layer, self.ops, matmul_dtype) for layer in base.layers]
        # linear_panels against oneDNN, measured here on the MLP's weights (the bulk of them),
        # once per model and thread count in a process
        measured = MEASURED_ROWS.setdefault(model, {})
        threads = torch.get_num_threads()
        if threads not in measured:
            measured[threads] = rows_kernel_max(
                [x for layer in layers for x in (layer.gate_up, layer.down)]
            )
            log.info(
                "linear_panels up to %d rows at %d threads (oneDNN above)",
                measured[threads],
                threads,
            )
        self.rows_kernel_max = measured[threads]
        rows = self.rows_kernel_max
        self.fuse_decode = True
        """False: decode steps take the layer loop too (``decode_layers`` must equal it)."""
        self.decode_path = DecodePath(rows, ROWS_KERNEL_MAX)
        """One ``decode_layers`` call or the layer loop, by a decode step's row count."""
        self.lm_head = dataclasses.replace(self.lm_head, rows_max=rows)
        self.greedy_head: GreedyHead | None = None
        """The float32 head's int8 screen for rows that need only their argmax. None where
        the head has code panels: per-step alternation on SmolLM2-135M's 8-bit head (2-core
        AMD EPYC, one row) measured 11.82 / 12.64 / 11.38 ms a step with the screen against
        11.87 / 12.91 / 11.35 with the coded head whole."""
        head = self.lm_head
        if head.kernels is not None and head.matmul_dtype is None and head.codes is None:
            try:
                self.greedy_head = GreedyHead.build(weight, self.ops)
            except ValueError as exc:  # a head no bound holds for: the whole head always
                log.info("no greedy screen of the head: %s", exc)
        self.low_activations = matmul_dtype is not None and all(
            x.pack is not None for layer in layers for x in (layer.o, layer.gate_up, layer.down)
        )
        """bf16 mode on oneDNN: a step's norms, o, gate/up, silu_mul and down may hand each
        other bf16 activations (``_forward_native``)."""
        self.layers = [
            dataclasses.replace(
                layer,
                qkv=dataclasses.replace(layer.qkv, rows_max=rows),
                o=dataclasses.replace(layer.o, rows_max=rows),
                gate_up=dataclasses.replace(layer.gate_up, rows_max=rows),
                down=dataclasses.replace(layer.down, rows_max=rows),
            )
            for layer in layers
        ]
        # decode_layers' arguments, or None (no kernels, or a model the op cannot run)
        self.decode_weights = decode_arguments(self.layers) if self.ops is not None else None
        self.codes_rows_max = max(x.codes_rows_max for x in self.layers[0].projections())
        """The most rows a decode step multiplies on code panels (``Linear.codes_rows_max``;
        0: no codes)."""
        coded = self.codes_rows_max > 0
        self.decode_codes = decode_arguments(self.layers, coded=True) if coded else None
        """``decode_weights`` with code panels where the weights have them, for steps of at
        most ``codes_rows_max`` rows (None: no codes)."""

    def codes_line(self) -> str:
        """The projections multiplied from exact weight codes, for the runner's line (empty
        where none has them)."""
        linears = [x for layer in self.layers for x in layer.projections()] + [self.lm_head]
        coded = [x.codes for x in linears if x.codes is not None]
        if not coded:
            return ""
        mib = sum(c.numel() for c in coded) / 2**20
        rows = max(x.codes_rows_max for x in linears)
        return (
            f"; {len(coded)} of {len(linears)} projections read from their exact weight codes"
            f" ({mib:.0f} MiB) up to {rows} rows"
        )

    @staticmethod
    def why_not(model: Any) -> str | None:
        """Why this module cannot run ``model`` exactly; None when it can."""
        config = getattr(model, "config", None)
        model_type = getattr(config, "model_type", None)
        if model_type not in SUPPORTED:
            return f"model type {model_type!r} is not one of {list(SUPPORTED)}"
        base = getattr(model, "model", None)
        layers = getattr(base, "layers", None)
        if base is None or layers is None or not hasattr(model, "lm_head"):
            return "no model.layers / lm_head"
        if getattr(config, "pretraining_tp", 1) not in (None, 1):
            return "pretraining_tp > 1"
        act = str(getattr(config, "hidden_act", "silu"))
        if act != "silu":
            return f"activation {act!r} (only SiLU-gated MLPs)"
        for layer in layers:
            attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
            names = ("q_proj", "k_proj", "v_proj", "o_proj")
            if attn is None or any(not hasattr(attn, n) for n in names):
                return "an attention module without q/k/v/o projections"
            if mlp is None or any(not hasattr(mlp, n) for n in ("gate_proj", "up_proj")):
                return "an MLP without gate/up/down projections"
        return None

    @classmethod
    def supports(cls, model: Any) -> bool:
        return cls.why_not(model) is None

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """transformers' RMSNorm: in float32, then the weight times the input dtype."""
        dtype = x.dtype
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return weight * x32.to(dtype)

    @staticmethod
    def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``x [1, H, N, D]`` rotated; ``cos``/``sin [1, 1, N, D]`` (transformers' order)."""
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return (x * cos) + (rotated * sin)

    @torch.no_grad()
    def forward(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        kvs: Sequence[SequenceKV] | None,
        spans: Sequence[tuple[int, int]],
        logit_rows: torch.Tensor,
        argmax_only: bool = False,
    ) -> torch.Tensor:
        """Logits ``[len(logit_rows), V]`` of one step.

        Args:
            ids: ``[N]`` the packed tokens.
            positions: ``[N]`` each token's position in its sequence.
            kvs: each span's sequence KV, in packed order (its pass already begun), or
                None for a throw-away forward where each span attends to itself only.
            spans: each sequence's ``(start, length)`` in the packed row.
            logit_rows: ``[R]`` packed indices whose logits are wanted.
            argmax_only: only each row's first maximum is read: up to
                ``greedy_head.ROWS_MAX`` rows the float32 head multiplies on
                ``linear_panels`` then come from ``greedy_head`` (the same argmax; ``-inf``
                at the tokens it rules out).
        """
        n = ids.shape[0]
        hq, hkv, dim = self.num_heads, self.num_kv_heads, self.head_dim
        h = self.embed(ids)  # [N, H]
        cos, sin = self.rope.rows(h, positions)  # [N, D]
        batch, rest = DecodeBatch.collect(kvs, spans, h.dtype) if kvs is not None else (None, [])
        ops = self.ops if h.dtype == torch.float32 and h.device.type == "cpu" else None
        # the last layer's rows past attention: only those whose logits are wanted (each
        # row's o/MLP reads that row alone; the KV needs every row's k/v, not its output)
        keep = None if logit_rows.shape[0] == n else logit_rows
        if ops is not None:
            decode_only = self._decode_only(batch, rest, n)
            one_call = decode_only and self.decode_path.fused(n)
            start = time.perf_counter()
            if one_call:
                assert batch is not None
                self._decode_layers(ops, h, cos, sin, batch)
                # index_select: no OpenMP region for a decode batch's rows (h[rows] opens one)
                last = h.index_select(0, logit_rows)
            else:
                last = self._forward_native(ops, h, cos, sin, kvs, spans, batch, rest, keep)
                if keep is None:
                    last = last.index_select(0, logit_rows)
            if decode_only:
                self.decode_path.record(n, one_call, time.perf_counter() - start)
            normed = ops.rms_norm(last, self.final_norm, self.eps)
            head = self.lm_head
            if (
                argmax_only
                and self.greedy_head is not None
                and normed.shape[0] <= min(head.rows_max, GREEDY_ROWS_MAX)
            ):
                return self.greedy_head.logits(normed)
            return head(normed)
        cos, sin = cos[None, None], sin[None, None]  # [1, 1, N, D]
        last_index = len(self.layers) - 1
        for index, layer in enumerate(self.layers):
            x = self._norm(h, layer.input_norm)
            qkv = layer.qkv(x)  # [N, (Hq+2Hkv) D]
            q, k, v = qkv.split([hq * dim, hkv * dim, hkv * dim], dim=-1)
            q, k, v = q.view(1, n, hq, dim), k.view(1, n, hkv, dim), v.view(1, n, hkv, dim)
            if layer.q_norm is not None and layer.k_norm is not None:
                q, k = self._norm(q, layer.q_norm), self._norm(k, layer.k_norm)
            q = self._rope(q.transpose(1, 2), cos, sin)  # [1, Hq, N, D]
            k = self._rope(k.transpose(1, 2), cos, sin)  # [1, Hkv, N, D]
            v = v.transpose(1, 2)
            out = attend_layer(
                index, q, k, v, kvs, spans, batch, rest, self.scale, self.matmul_dtype
            )
            out = out.reshape(n, hq * dim)
            if index == last_index and keep is not None:
                h, out = h[keep], out[keep]
            h = h + layer.o(out)
            x = self._norm(h, layer.post_norm)
            gate_up = layer.gate_up(x)
            gate, up = gate_up.chunk(2, dim=-1)
            h = h + layer.down(self.act(gate) * up)
        if keep is None:
            h = h[logit_rows]
        return self.lm_head(self._norm(h, self.final_norm))

    def _decode_only(self, batch: DecodeBatch | None, rest: Sequence[int], rows: int) -> bool:
        """Whether a step may run all its layers in one ``decode_layers`` call: every row a
        seated decode row on kvtier's kernels, at most ``ROWS_KERNEL_MAX`` rows, the fused
        weights there and ``fuse_decode`` set (``decode_path`` then picks the path)."""
        return (
            self.decode_weights is not None
            and self.fuse_decode
            and batch is not None
            and not rest
            and batch.native_only
            and rows <= ROWS_KERNEL_MAX
        )

    def _decode_layers(
        self,
        ops: Any,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: DecodeBatch,
    ) -> None:
        """Every layer of a decode-only step (``_decode_only``) in one ``decode_layers``
        call; ``h`` mutated to the last layer's output."""
        coded = self.decode_codes is not None and h.shape[0] <= self.codes_rows_max
        fused = self.decode_codes if coded else self.decode_weights
        assert fused is not None
        ops.decode_layers(
            h,
            cos,
            sin,
            fused[0],
            fused[1],
            batch.slab.data,
            batch.seat_idx,
            batch.tail_pos,
            batch.lo,
            batch.hi,
            batch.rows,
            self.num_heads,
            self.num_kv_heads,
            self.layers[0].down.in_features,
            self.scale,
            self.eps,
        )
        batch.done()

    def _forward_native(
        self,
        ops: Any,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kvs: Sequence[SequenceKV] | None,
        spans: Sequence[tuple[int, int]],
        batch: DecodeBatch | None,
        rest: Sequence[int],
        keep: torch.Tensor | None,
    ) -> torch.Tensor:
        """``forward``'s layers on kvtier's CPU kernels (float32): each residual add fused
        with the next RMSNorm, RoPE in place on the q/k projections' output, SiLU·mul in one
        op. ``h [N, H]`` is the residual stream, mutated through the layers; ``cos``/``sin
        [N, D]``. Returns the last layer's output of the rows ``keep`` (``[len(keep), H]``, a
        new tensor: the last layer's o-projection and MLP run on those rows only), or of
        every row (``h`` itself) when ``keep`` is None."""
        n = h.shape[0]
        hq, hkv, dim = self.num_heads, self.num_kv_heads, self.head_dim
        eps = self.eps
        last_index = len(self.layers) - 1
        # bf16 mode, rows oneDNN multiplies: the norms hand the projections x already
        # rounded, and o, gate/up (through silu_mul) and down stay bf16 into the next op
        low = self.low_activations and n > self.layers[0].gate_up.rows_max
        x = ops.rms_norm(h, self.layers[0].input_norm, eps, low)
        for index, layer in enumerate(self.layers):
            qkv = layer.qkv(x)  # [N, (Hq+2Hkv) D]
            q, k, v = qkv.split([hq * dim, hkv * dim, hkv * dim], dim=-1)
            q, k, v = q.view(n, hq, dim), k.view(n, hkv, dim), v.view(n, hkv, dim)
            if layer.q_norm is not None and layer.k_norm is not None:
                q, k = self._norm(q, layer.q_norm), self._norm(k, layer.k_norm)
            ops.rope_(q, cos, sin)
            ops.rope_(k, cos, sin)
            q4, k4 = q[None].transpose(1, 2), k[None].transpose(1, 2)  # [1, H, N, D] views
            v4 = v[None].transpose(1, 2)
            out = attend_layer(
                index, q4, k4, v4, kvs, spans, batch, rest, self.scale, self.matmul_dtype
            )
            out = out.view(n, hq * dim)
            if index == last_index and keep is not None:
                h, out = h.index_select(0, keep), out.index_select(0, keep)
            x = ops.add_rms_norm(h, layer.o(out, low), layer.post_norm, eps, low)
            down = layer.down(ops.silu_mul(layer.gate_up(x, low)), low)
            if index < last_index:
                x = ops.add_rms_norm(h, down, self.layers[index + 1].input_norm, eps, low)
            else:
                h += down
        return h
