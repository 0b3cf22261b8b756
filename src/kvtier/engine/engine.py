"""The serving engine: the public API, the hand-off queue and the worker thread.

``Engine`` owns the worker thread, the ``Handoff`` (thread-safe: ``submit`` from any thread
puts a handle there; the worker moves handles into the scheduler's waiting line) and the
``EngineMetrics`` it shares with the scheduler. The worker runs
``kvtier.engine.scheduler.BatchScheduler``: continuous batching, a ``step()`` over every
running sequence — schedule → run (one forward packing prefill pieces and every decoding
sequence's next token) → postprocess. ``max_batch_size = 1`` serves one request at a time
in admission order.

Each request reuses the longest cached prefix of its prompt from any tier, prefills the
rest in chunk-sized pieces, then decodes token by token with its own sampling parameters.

Process-wide effect: the constructor calls ``gc.freeze()`` once its model and tiers are
built, so the collector no longer scans the objects alive at that point (they stay alive
and are still freed normally when unreferenced; ``gc.unfreeze()`` undoes it); and it lets
the calling thread's idle OpenMP helpers exit (``kvtier.engine.openmp``), so the worker's
parallel operators are not throttled; a later parallel region there makes new ones.
"""

from __future__ import annotations

import gc
import itertools
import logging
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from kvtier.engine.admission import Limits, check_fits, check_prompt_length
from kvtier.engine.config import EngineConfig
from kvtier.engine.handoff import Handoff
from kvtier.engine.metrics import EngineMetrics
from kvtier.engine.openmp import release_idle_helpers
from kvtier.engine.request import (
    EngineClosedError,
    ParamError,
    Request,
    RequestHandle,
    SamplingParams,
    as_prompt_ids,
)
from kvtier.engine.runner import make_runner
from kvtier.engine.sampling import eos_ids
from kvtier.engine.scheduler import BatchScheduler
from kvtier.engine.stats import EngineStats
from kvtier.engine.work import WorkModel
from kvtier.hf import attach, model_spec
from kvtier.hugepages import request_huge_pages
from kvtier.kv.layout import DTYPES
from kvtier.manager import KVManager
from kvtier.models import load_model, model_identity
from kvtier.profiles import resolve_rates
from kvtier.runtime import CacheStats, SeatSlab, SequenceKV

log = logging.getLogger(__name__)


class Engine:
    """Generates for queued requests from one model, over kvtier's tiers.

    The engine reserves one ``kvtier.runtime.SequenceKV`` per sequence it may run at once
    (``config.max_running``: its own device tier, tail and device⇄host link) when it
    starts, over one shared ``KVManager`` (host and disk tiers). Sealed chunks stay in the
    tiers after a request, so a later request or conversation turn that shares a prefix
    adopts that KV instead of recomputing it. Requests are batched continuously (see
    ``kvtier.engine.scheduler``).

    Thread-safety: ``submit``, ``stats`` and ``close`` may be called from any thread:
    ``submit`` puts the handle on the ``Handoff`` (one lock), ``stats`` reads the hand-off's
    occupancy and the shared ``metrics``. The scheduler, the model, the tokenizer's decode
    and the caches are used only by the worker thread (and ``encode``/``encode_chat``,
    which only tokenize, by any).

    Attributes:
        metrics: the counters and histograms the engine and its scheduler write.
        limits: what one sequence may use (checked in ``submit``).

    Args:
        model: a transformers causal LM (eval mode); its attention is switched to kvtier's.
        tokenizer: its tokenizer.
        config: queue bound, context limit, device cache and tiers.
        model_id: identity of the weights in chunk keys (default: a digest of the model).
        manager: share tiers with other engines; the caller then closes it. Default: the
            engine builds one from ``config.manager`` and closes it in ``close``.

    Raises:
        UnsupportedModelError: kvtier cannot run the model exactly (one line: why).
        ProfileMissingError: placement ``auto`` without rates and no profile of the model
            on this machine (``kvtier.calibrate.ensure_profile`` measures one).
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        config: EngineConfig | None = None,
        *,
        model_id: str | None = None,
        manager: KVManager | None = None,
    ) -> None:
        self.config = config or EngineConfig()
        self.model = model
        self.tokenizer = tokenizer
        self.model_id = model_id or model_identity(model)
        self.device = next(model.parameters()).device
        text_config = model.config.get_text_config()
        self.max_model_len = self.config.max_model_len or int(text_config.max_position_embeddings)
        self.vocab_size = int(model.get_input_embeddings().num_embeddings)
        self.eos_ids = eos_ids(model, tokenizer)
        self._owns_manager = manager is None
        # Refuse, with the reason, a model kvtier cannot run exactly (before any state).
        chunk_tokens = manager.layout.chunk_tokens if manager else self.config.manager.chunk_tokens
        # bf16 mode keeps the KV in bf16 as well (half the bytes a decode step reads)
        low = None if self.config.matmul_dtype is None else DTYPES[self.config.matmul_dtype]
        self.spec = model_spec(model, chunk_tokens, low)
        if manager is None:
            manager = KVManager(self.spec.layout, self.model_id, self.config.manager)
        self.spec.check_manager(manager)
        self.manager = manager
        attach(model)
        self.metrics = EngineMetrics()
        self._handoff = Handoff(
            self.config.max_queued,
            self.config.max_running,
            self.metrics,
            WorkModel(),
            self.config.max_queue_s,
        )
        # Rates: given, or this machine's profile of the model (``placement="auto"``
        # without either raises ProfileMissingError; ``kvtier serve`` calibrates first).
        cache_config = resolve_rates(self.config.cache, self.model_id)
        cache_device = torch.device(cache_config.device or self.device)
        # All layers full attention: the sequences' pools and tails are rows of one slab,
        # so a decode step attends every sequence with one call per layer.
        slab = (
            SeatSlab(
                self.spec.layout,
                self.config.max_running,
                self.config.cache.device_budget_bytes,
                cache_device,
            )
            if all(w is None for w in self.spec.windows)
            else None
        )

        def new_cache(seat: int) -> SequenceKV:
            return SequenceKV(
                self.manager,
                self.spec.windows,
                cache_config,
                cache_device,
                self.spec.model_type,
                (slab, seat) if slab is not None else None,
            )

        self.runner = make_runner(model, self.device, self.config.runner, low)
        log.info("model runner: %s", self.runner.name)
        self._scheduler = BatchScheduler(  # reserves the caches (the device budget)
            self.runner,
            tokenizer,
            self.manager,
            self.config,
            new_cache,
            self._handoff,
            self.metrics,
            self.eos_ids,
        )
        self._close_lock = threading.Lock()  # one close at a time
        self._ids = itertools.count()
        caches = self._scheduler.caches.all
        layout = self.manager.layout
        self.limits = Limits(
            vocab_size=self.vocab_size,
            max_model_len=self.max_model_len,
            chunk_tokens=layout.chunk_tokens,
            chunk_nbytes=layout.chunk_nbytes,
            device_slots=self._device_slots(caches[0] if caches else None),
            host_slots=self.manager.host.num_slots,
        )
        # The model, tokenizer and tiers are long-lived: moved out of the collector's view
        # (as vLLM does at start), a step's garbage collections no longer walk their
        # ~370,000 objects (the offline workload: 1-3 s of ~24, docs/benchmarks.md).
        gc.collect()
        gc.freeze()
        # Building ran torch's parallel regions on this thread: its idle OpenMP helpers go,
        # so the worker's own regions are not throttled (kvtier.engine.openmp).
        release_idle_helpers()
        self._worker = threading.Thread(target=self._run, name="kvtier-engine", daemon=True)
        self._worker.start()

    @classmethod
    def from_pretrained(
        cls,
        path: str | None = None,
        config: EngineConfig | None = None,
        *,
        dtype: torch.dtype = torch.float32,
        device: str | None = None,
    ) -> Engine:
        """An engine over ``kvtier.models.load_model(path)`` (None: the embedded model).
        Asks for huge pages first (``kvtier.hugepages``: mutates ``os.environ``)."""
        request_huge_pages()
        loaded = load_model(path, dtype=dtype, device=device)
        return cls(loaded.model, loaded.tokenizer, config, model_id=loaded.model_id)

    # ---- tokenizing ------------------------------------------------------------------------

    def encode(self, prompt: str) -> list[int]:
        """Token ids of a plain-text prompt (with the tokenizer's usual special tokens)."""
        return list(self.tokenizer(prompt)["input_ids"])

    def encode_chat(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        """Token ids of a conversation, formatted by the tokenizer's chat template and
        ending with the assistant's turn prompt."""
        if not messages:
            raise ParamError("messages", "must hold at least one message")
        if not getattr(self.tokenizer, "chat_template", None):
            raise ParamError(
                "messages", "this model's tokenizer has no chat template; use completions"
            )
        text = self.tokenizer.apply_chat_template(
            [dict(m) for m in messages], add_generation_prompt=True, tokenize=False
        )
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def token_text(self, token_id: int) -> str:
        """The text of one token, special tokens included (for log-probabilities)."""
        return str(self.tokenizer.decode([token_id], skip_special_tokens=False))

    # ---- requests --------------------------------------------------------------------------

    def submit(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        cache_salt: str = "",
    ) -> RequestHandle:
        """Queue a request; returns its handle at once (generation runs on the worker).

        ``cache_salt`` names the tenant: the request reuses KV only from requests with the
        same salt, and its own chunks are keyed under it in every tier.

        Raises:
            ParamError: an empty prompt or a token id outside the vocabulary.
            ContextLengthError: prompt plus ``max_tokens`` exceed ``max_model_len``.
            QueueFullError: ``config.max_queued`` requests are already waiting.
            EngineClosedError: ``close`` has been called, or the worker died.
        """
        params = params or SamplingParams()
        if not isinstance(prompt, str):
            check_prompt_length(len(prompt), self.limits)  # before its ids are looked at
        ids = as_prompt_ids(self.encode(prompt) if isinstance(prompt, str) else prompt)
        check_fits(ids, params, self.limits)
        request_id = request_id or f"req-{next(self._ids)}"
        handle = RequestHandle(Request(request_id, ids, params, cache_salt))
        self._handoff.put(handle)
        return handle

    def stats(self) -> EngineStats:
        """A snapshot of counters, latencies, occupancy and the tiers' stats."""
        now = self._handoff.occupancy()
        caches = [c.stats() for c in self.caches]
        return self.metrics.stats(
            queue_depth=now.queued + now.resuming,
            running=now.running,
            manager=self.manager.stats(),
            cache=CacheStats.total(caches) if caches else None,
        )

    @property
    def closed(self) -> bool:
        """``close`` has been called (the engine accepts no more requests)."""
        return self._handoff.closing

    @property
    def dead_reason(self) -> str | None:
        """Why the worker thread died (None while it lives): the engine serves no more."""
        return self._handoff.dead_reason

    def close(self, drain: bool = True, timeout_s: float | None = None) -> bool:
        """Stop accepting requests, finish or cancel the rest, and release the tiers.

        With ``drain`` every queued and running request is generated to its end, for at
        most ``timeout_s`` (None: no limit); then, or without ``drain``, what is left ends
        with ``finish_reason="cancelled"`` at the worker's next step. Then the caches are
        closed and, when the engine owns its manager, the manager too — after writing the
        host tier to disk when a disk tier is configured, so a restart finds the sessions'
        KV — and the objects frozen at start return to the garbage collector. Blocks until
        done; idempotent.

        Returns:
            True when the worker stopped; False when it was still inside a step after the
            timeout and a grace period (a wedged forward): the tiers are flushed anyway and
            the caller should exit the process.
        """
        with self._close_lock:
            if not self._handoff.close(cancel=not drain):
                return not self._worker.is_alive()
            self._worker.join(timeout_s)
            if self._worker.is_alive():
                log.warning("drain timed out after %.0f s; cancelling what is left", timeout_s)
                self._handoff.cancel_all()
                self._worker.join(_CANCEL_GRACE_S)
            stopped = not self._worker.is_alive()
            if stopped:
                self._scheduler.close()
            if self._owns_manager:
                self.manager.close(flush_host_to_disk=self.manager.disk is not None)
            # What start froze out of the collector's view (this engine's and whatever else
            # lived then) goes back to it, so a closed engine's cycles are freed.
            gc.unfreeze()
            return stopped

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- the worker ------------------------------------------------------------------------

    @property
    def caches(self) -> list[SequenceKV]:
        """The sequences' caches (each with its device tier), reserved at start."""
        return list(self._scheduler.caches.all)

    def _run(self) -> None:
        """The worker thread. A fault in a step fails that step's sequences; a fault that
        escapes even that kills the worker: every waiting request then fails with the
        reason, ``dead_reason`` says it (``/health`` answers 503) and ``submit`` refuses."""
        try:
            self._serve()
        except BaseException as exc:
            reason = f"{type(exc).__name__}: {exc}"
            log.critical("the engine's worker died: %s", reason, exc_info=exc)
            for handle in self._handoff.kill(reason):
                handle.fail(EngineClosedError(f"the engine's worker died ({reason})"))

    def _serve(self) -> None:
        """Move submitted handles into the scheduler and step it, until closed and idle."""
        scheduler, handoff = self._scheduler, self._handoff
        with torch.no_grad():  # grad mode is per thread
            while handoff.wait(scheduler.busy):
                scheduler.add(handoff.take())
                try:
                    scheduler.step()
                except Exception as exc:  # a scheduler fault: its sequences fail, not the engine
                    log.exception("a scheduler step failed; its sequences fail")
                    scheduler.fail_all(exc)

    def _device_slots(self, cache: SequenceKV | None) -> int:
        """Chunks one sequence's arena keeps resident (all reserved alike); a model of
        sliding layers only keeps its windows, so any context fits."""
        if cache is None:
            return 0
        slots = cache.arena.resident_slots
        return (
            slots if slots is not None else self.max_model_len // self.spec.layout.chunk_tokens + 1
        )


# How long a worker still inside a step after a drain timeout gets to reach the next step.
_CANCEL_GRACE_S = 5.0
