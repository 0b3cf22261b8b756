"""``KvtierConnector``: kvtier's tiers behind vLLM's v1 KV connector API.

Loaded the documented way::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KvtierConnector",
        "kv_connector_module_path": "kvtier.vllm.connector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"host_mb": 2048, "disk_dir": "/var/kv"}}'

vLLM computes; kvtier keeps the KV. The worker side owns the tiers (a ``KVManager``): it
scatters chunks into vLLM's blocks layer by layer before the attention reads them
(``WorkerSide``), gathers the chunks each forward completes into the host tier, from where
the manager writes them down behind compute, and answers the scheduler's lookups on a Unix
socket (``kvtier.vllm.lookup``: vLLM runs the two sides in different processes). The
scheduler side (``SchedulerSide``) asks how many prompt tokens kvtier holds, one lookup
across host, disk and the shared tier, and plans each step's loads and saves. Chunk keys,
tiers, links, write-behind and checksums are kvtier's own, unchanged.

A load that fails (a chunk missing or corrupt, a store down) is reported to vLLM as failed
blocks, with ``kv_load_failure_policy`` set to ``recompute``: vLLM recomputes them. What
kvtier cannot hold exactly is refused at start in one line: MLA, several KV cache groups
(sliding-window or hybrid layouts), a quantised KV dtype, a backend other than the CPU one.

Thread-safety: vLLM calls each side from one thread; the worker's manager also answers
lookups on the lookup server's threads (``KVManager`` is thread-safe).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvtier.kv.keys import KeyHasher, Namespace
from kvtier.kv.layout import KVLayout
from kvtier.manager import KVManager
from kvtier.vllm.identity import vllm_model_id
from kvtier.vllm.lookup import LookupClient, LookupServer, socket_address
from kvtier.vllm.metadata import StepPlan
from kvtier.vllm.paged import PagedLayout
from kvtier.vllm.scheduler_side import SchedulerSide
from kvtier.vllm.settings import for_bursts, manager_config
from kvtier.vllm.worker_side import WorkerSide

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

_SOURCES = {"host": CacheHitSource.HOST, "disk": CacheHitSource.DISK}


class UnsupportedModelError(ValueError):
    """The model or vLLM's set-up is one kvtier's connector cannot serve (one line: why)."""


class KvtierMetadata(StepPlan, KVConnectorMetadata):
    """A ``StepPlan`` as vLLM's connector metadata type."""


def _refuse(vllm_config: Any, kv_cache_config: Any) -> None:
    model = vllm_config.model_config
    name = model.model
    if getattr(model, "use_mla", False):
        raise UnsupportedModelError(
            f"kvtier connector: {name} uses MLA (a latent KV kvtier's chunks do not hold); "
            "serve it without the connector"
        )
    groups = len(getattr(kv_cache_config, "kv_cache_groups", ()) or ())
    if groups > 1:
        raise UnsupportedModelError(
            f"kvtier connector: {name} has {groups} KV cache groups (sliding-window, mamba "
            "or other hybrid layers); the connector holds models with one full-attention group"
        )
    dtype = vllm_config.cache_config.cache_dtype
    if dtype not in ("auto", None):
        raise UnsupportedModelError(
            f"kvtier connector: kv_cache_dtype {dtype!r}; the connector holds KV in the "
            "model's dtype (kv_cache_dtype auto)"
        )


class KvtierConnector(KVConnectorBase_V1):
    """See the module docstring."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        _refuse(vllm_config, kv_cache_config)
        transfer = vllm_config.kv_transfer_config
        config = manager_config(transfer.kv_connector_extra_config)
        model = vllm_config.model_config
        layout = KVLayout.from_model_config(model.hf_config, model.dtype, config.chunk_tokens)
        step_tokens = int(vllm_config.scheduler_config.max_num_batched_tokens)
        config = for_bursts(config, step_tokens, layout.chunk_nbytes)
        block_size = int(vllm_config.cache_config.block_size)
        paged = PagedLayout(layout, block_size)
        model_id = vllm_model_id(model.model, getattr(model, "revision", None))
        lookups = socket_address(str(transfer.engine_id))
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        self._client: LookupClient | None = None
        self._server: LookupServer | None = None
        if role == KVConnectorRole.SCHEDULER:
            # A cache's failed load is a miss: vLLM recomputes the blocks (read after this).
            transfer.kv_load_failure_policy = "recompute"
            self._client = LookupClient(lookups)
            hasher = KeyHasher(Namespace(model_id, layout, config.tenant_salt))
            self._scheduler = SchedulerSide(
                hasher,
                self._client.held_tiers,
                block_size,
                transfer.is_kv_consumer,
                transfer.is_kv_producer,
            )
            log.info(
                "kvtier connector: %s, chunks of %d tokens (%d blocks of %d), tiers %s",
                model_id,
                layout.chunk_tokens,
                paged.blocks_per_chunk,
                block_size,
                " -> ".join(t.kind for t in config.tiers),
            )
        else:
            manager = KVManager(layout, model_id, config)
            self._worker = WorkerSide(manager, paged)
            self._server = LookupServer(manager, lookups)

    # ---- worker side ------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register(kv_caches)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        assert self._worker is not None
        plan = self._get_connector_metadata()
        if plan.loads:
            self._worker.start_load(plan.loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        assert self._worker is not None
        self._worker.wait_layer(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return None  # whole chunks are gathered once the forward is done (wait_for_save)

    def wait_for_save(self) -> None:
        assert self._worker is not None
        self._worker.finish_step()
        plan = self._get_connector_metadata()
        if plan.saves:
            self._worker.save(plan.saves)

    def get_block_ids_with_load_errors(self) -> set[int]:
        assert self._worker is not None
        return self._worker.take_failed_blocks()

    def shutdown(self) -> None:
        """Stop answering lookups, then flush the writes still queued below host."""
        if self._client is not None:
            self._client.close()
        if self._server is not None:
            self._server.close()
        if self._worker is not None:
            self._worker.manager.close()

    # ---- scheduler side ---------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.matched_tokens(request, num_computed_tokens), False

    def get_external_cache_hit_sources(
        self, request: Any, num_external_tokens: int
    ) -> dict[CacheHitSource, int]:
        assert self._scheduler is not None
        split: dict[CacheHitSource, int] = {}
        for tier, tokens in self._scheduler.hit_tiers(request, num_external_tokens).items():
            source = _SOURCES.get(tier, CacheHitSource.EXTERNAL_UNSPECIFIED)
            split[source] = split.get(source, 0) + tokens
        return split

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        assert self._scheduler is not None
        block_ids = blocks.get_block_ids()[0] if blocks is not None else []
        self._scheduler.after_alloc(request, block_ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        assert self._scheduler is not None
        plan = self._scheduler.build(scheduler_output)
        return KvtierMetadata(plan.loads, plan.saves)

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        self._scheduler.finished(request)
        return False, None  # saves complete within their step: the blocks may go
