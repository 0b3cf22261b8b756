"""Engine configuration: admission, context and the KV tiers it serves from."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvtier.config import HostConfig, ManagerConfig, MiB, TieredCacheConfig
from kvtier.validate import check_int, check_number, is_int


@dataclass(frozen=True)
class EngineConfig:
    """The serving engine.

    Attributes:
        max_queued: requests waiting for admission (the running one not counted); a
            ``submit`` beyond this raises ``QueueFullError``.
        max_queue_s: admission by cost: a ``submit`` whose predicted engine seconds,
            with those of every request queued or running ahead of it, exceed this
            raises ``QueueFullError`` with a retry after the predicted drain time
            (``kvtier.engine.work``). None: only ``max_queued`` bounds the queue.
        max_model_len: longest sequence (prompt + output) accepted; None takes the model
            config's ``max_position_embeddings``.
        cache: the per-sequence device cache (device budget, staging, device⇄host link).
        manager: the shared tiers below the device (host, disk), chunk size and write
            policy: the KV every request can reuse.
        max_batch_size: most sequences run together (continuous batching): requests are
            admitted while the device budget has room, prefilled in chunk-sized pieces and
            decoded together, all in one packed forward per step. 1 serves one request at
            a time, in admission order.
        device_budget_bytes: device bytes for all running sequences together: the engine
            reserves one ``cache.device_budget_bytes`` cache per sequence that fits (at
            most ``max_batch_size``) when it starts. None:
            ``max_batch_size × cache.device_budget_bytes``.
        preempt_after_s: when the oldest waiting request has
            waited this long and does not fit, the youngest decoding sequence is preempted:
            its KV stays in the host/disk tiers and it resumes later from there. None:
            never preempt.
        prefill_tokens_per_step: prompt tokens a step's forward carries besides the
            decoding sequences' tokens, in pieces ending on chunk boundaries (one piece per
            prefilling sequence). None: one chunk, so decoding sequences wait at most one
            chunk's prefill per token; more trades their inter-token latency for
            throughput (fewer steps, larger forwards).
        reuse_overlap: a reused prefix whose chunks lie below host (disk) has its front
            computed while its back loads, meeting where the two cross, when the cost
            model predicts that puts it in place in at most 3/4 of the time loading it all
            takes (``kvtier.engine.overlap``). False: those chunks always load first.
        runner: the model's forward: ``auto`` runs kvtier's own for the Llama family
            (Llama, Mistral, Qwen2, Qwen3) and transformers' modelling for the rest;
            ``kvtier`` requires kvtier's; ``transformers`` always uses transformers'.
        matmul_dtype: None: the projections multiply in the weights' dtype (greedy tokens
            equal transformers'); ``bfloat16``: in bf16 on oneDNN or AMX, prefill
            attention on AMX tiles (without AMX, long passes on torch's bf16 flash
            kernel), and the KV cache (every tier) in bf16, half the bytes a decode step
            reads (kvtier's own forward only; float32 accumulation and residual stream):
            about twice the projections' rate on a CPU with AVX-512 BF16, and tokens that
            drift from transformers' by a measured amount (``kvtier bench peers --bf16``).
    """

    max_queued: int = 64
    max_queue_s: float | None = None
    max_model_len: int | None = None
    cache: TieredCacheConfig = field(
        default_factory=lambda: TieredCacheConfig(device_budget_bytes=128 * MiB)
    )
    manager: ManagerConfig = field(
        default_factory=lambda: ManagerConfig(host=HostConfig(capacity_bytes=1024 * MiB))
    )
    max_batch_size: int = 8
    device_budget_bytes: int | None = None
    preempt_after_s: float | None = None
    prefill_tokens_per_step: int | None = None
    reuse_overlap: bool = True
    runner: str = "auto"
    matmul_dtype: str | None = None

    @property
    def total_device_budget_bytes(self) -> int:
        """Device bytes for all running sequences (see ``device_budget_bytes``)."""
        if self.device_budget_bytes is not None:
            return self.device_budget_bytes
        return self.max_batch_size * self.cache.device_budget_bytes

    @property
    def max_running(self) -> int:
        """Sequences that may run at once: the batch size, within the device budget."""
        per_sequence = self.cache.device_budget_bytes
        return min(self.max_batch_size, self.total_device_budget_bytes // per_sequence)

    def __post_init__(self) -> None:
        check_int("max_batch_size", self.max_batch_size, 1)
        if self.device_budget_bytes is not None and (
            not is_int(self.device_budget_bytes)
            or self.device_budget_bytes < self.cache.device_budget_bytes
        ):
            raise ValueError(
                f"device_budget_bytes: must be an integer >= cache.device_budget_bytes "
                f"({self.cache.device_budget_bytes}, one sequence) or None, "
                f"got {self.device_budget_bytes!r}"
            )
        check_int("prefill_tokens_per_step", self.prefill_tokens_per_step, 1, none="one chunk")
        check_number("preempt_after_s", self.preempt_after_s, 0, none="never")
        check_int("max_queued", self.max_queued, 1)
        check_number("max_queue_s", self.max_queue_s, 0, none="no bound")
        check_int("max_model_len", self.max_model_len, 2, none="the model's")
        if self.matmul_dtype not in (None, "bfloat16"):
            raise ValueError(
                f"matmul_dtype: unknown {self.matmul_dtype!r}; accepted: None, 'bfloat16'"
            )
        if self.runner not in ("auto", "kvtier", "transformers"):
            raise ValueError(
                f"runner: unknown {self.runner!r}; accepted: ['auto', 'kvtier', 'transformers']"
            )
