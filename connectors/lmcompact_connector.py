"""``LMCompactConnector``: vLLM v1 KV connector that compacts, persists and reloads prefixes.

Load it with::

    --kv-transfer-config '{"kv_connector": "LMCompactConnector",
                           "kv_connector_module_path": "connectors.lmcompact_connector",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"policy": "snapkv", "budget": 0.5}}'

or ``LLM(..., kv_transfer_config=KVTransferConfig(...))``. Options:
:class:`connectors.config.ConnectorConfig`. The scheduler half
(:mod:`connectors.scheduler_side`) and the worker half (:mod:`connectors.worker_side`)
talk only through :class:`connectors.metadata.StepMetadata`.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from connectors import vllm_shim as shim
from connectors.config import ConnectorConfig, validate_against_engine
from connectors.memory.blocks import PrefixCacheGuard
from connectors.metadata import StepMetadata, WorkerReport
from connectors.scheduler_side import SchedulerHalf
from connectors.store_registry import STORES
from connectors.worker_side import WorkerHalf
from lmcompact.store import ChunkKeyer, StoreNamespace, TieredStore

logger = logging.getLogger(__name__)

STORE_LAYOUT = "lmcompact-rows-v1"
"""Stored chunks are per-head rows, independent of any engine page layout."""


class LMCompactMetadata(shim.KVConnectorMetadata):  # type: ignore[misc]
    """vLLM-typed envelope of one :class:`StepMetadata`."""

    def __init__(self, step: StepMetadata) -> None:
        self.step = step


class LMCompactWorkerMetadata(shim.KVConnectorWorkerMetadata):  # type: ignore[misc]
    """vLLM-typed envelope of one :class:`WorkerReport` (worker -> scheduler)."""

    def __init__(self, report: WorkerReport) -> None:
        self.report = report

    def aggregate(self, other: Any) -> LMCompactWorkerMetadata:
        # under tensor parallelism every rank reports the step: a union is exact, because
        # each rank reports its own slice keys (ChunkKey.for_rank) and its rank with packs
        if isinstance(other, LMCompactWorkerMetadata):
            self.report.merge(other.report)
        return self


def build_namespace(
    config: ConnectorConfig, facts: shim.EngineFacts, tp_rank: int = 0
) -> StoreNamespace:
    """The store namespace of ``tp_rank``'s slices (rank 0's also derives the chunk keys)."""
    params = config.namespace_params()
    if config.store_compacts and facts.sliding_window is not None:
        # sliding-window layers store each chunk's most recent rows (connectors/holes.py);
        # chunks stored before that must not load as if they did
        params["sliding_rows"] = "recent"
    return StoreNamespace(
        model_id=config.model_id or facts.model_id,
        kv_dtype=str(facts.dtype).removeprefix("torch."),
        kv_layout=STORE_LAYOUT,
        tp_rank=tp_rank,
        tp_world_size=facts.tp_size,
        policy_name=config.store_policy_name,
        policy_params=params,
    )


class LMCompactConnector(shim.KVConnectorBase_V1):  # type: ignore[misc]
    """KV-cache compaction connector (scheduler and worker roles)."""

    per_head_counts = False
    """Subclasses that mask per-head padding accept policies whose counts differ per head."""

    packs_in_place = False
    """Subclasses that compact prompts in place at prefill end accept ``compact_on: load``."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        shim.share_engine_logging()  # our INFO lines in the engine's log, in every process
        self.config = ConnectorConfig.from_extra(shim.transfer_extra_config(vllm_config))
        self.facts = shim.engine_facts(vllm_config)
        if self.config.compacts and self.config.compact_on == "load" and not self.packs_in_place:
            raise ValueError(
                f"compact_on 'load' needs a connector that packs prompts in place "
                f"(LMCompactMemoryConnector), not {type(self).__name__}"
            )
        validate_against_engine(
            self.config,
            block_size=self.facts.block_size,
            num_layers=self.facts.num_layers,
            num_kv_heads=self.facts.num_kv_heads,
            head_dim=self.facts.head_dim,
            per_head_counts=self.per_head_counts,
        )
        # the worker's values carry its rank's namespace (a slice of another rank is refused
        # as foreign); chunk keys are derived in rank 0's, then per rank (ChunkKey.for_rank)
        self.tp_rank = 0 if role == shim.KVConnectorRole.SCHEDULER else shim.tp_rank()
        self.namespace = build_namespace(self.config, self.facts, self.tp_rank)
        self.store: TieredStore = STORES.acquire(self.namespace, self.config.store_config())
        self.scheduler_half: SchedulerHalf | None = None
        self.worker_half: WorkerHalf | None = None
        self.cache_guard: PrefixCacheGuard | None = None  # scheduler side, prefix caching
        if self.config.load and not shim.recomputes_failed_loads(vllm_config):
            logger.warning(
                "kv_load_failure_policy is 'fail': a stored chunk that is missing or damaged "
                "when the worker loads it fails its request; set kv_load_failure_policy to "
                "'recompute' in --kv-transfer-config to recompute such requests instead"
            )
        self._rank_stores: list[TieredStore] = []  # scheduler, tensor parallel: ranks 1..
        if role == shim.KVConnectorRole.SCHEDULER:
            keyer = ChunkKeyer(self.namespace, self.config.chunk_size)
            self._rank_stores = [
                STORES.acquire(
                    build_namespace(self.config, self.facts, rank), self.config.store_config()
                )
                for rank in range(1, self.facts.tp_size)
            ]
            self.scheduler_half = SchedulerHalf(
                self.config,
                self.facts,
                self.store,
                keyer,
                rank_stores=[self.store, *self._rank_stores],
            )
        else:
            self.worker_half = WorkerHalf(
                self.config, self.facts, vllm_config, self.store, tp_rank=self.tp_rank
            )
        logger.info(
            "LMCompactConnector %s (tp rank %d of %d): policy=%s budget=%s chunk=%d tiers=%s "
            "vllm=%s",
            role,
            self.tp_rank,
            self.facts.tp_size,
            self.config.policy,
            self.config.budget,
            self.config.chunk_size,
            list(self.config.tiers),
            shim.vllm_version(),
        )

    def _worker(self) -> WorkerHalf:
        if self.worker_half is None:
            raise RuntimeError("worker-side call on the scheduler connector")
        return self.worker_half

    def _scheduler(self) -> SchedulerHalf:
        if self.scheduler_half is None:
            raise RuntimeError("scheduler-side call on the worker connector")
        return self.scheduler_half

    # ------------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker().register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        super().bind_connector_metadata(connector_metadata)
        if not isinstance(connector_metadata, LMCompactMetadata):
            raise TypeError(f"expected LMCompactMetadata, got {type(connector_metadata)!r}")
        self._worker().begin_step(connector_metadata.step)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self._worker().prepare(forward_context)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker().take_load_errors()

    def build_connector_worker_meta(self) -> LMCompactWorkerMetadata | None:
        report = self._worker().take_report()
        return None if report is None else LMCompactWorkerMetadata(report)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # loads complete inside start_load_kv

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return None  # pages are copied once, after the last layer, in wait_for_save

    def wait_for_save(self) -> None:
        self._worker().wait_for_save()

    def shutdown(self) -> None:
        if self.worker_half is not None:
            self.worker_half.shutdown()
        STORES.release(self.store)
        for store in self._rank_stores:
            STORES.release(store)

    # --------------------------------------------------------------- scheduler side
    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self._scheduler().num_new_matched_tokens(request, num_computed_tokens), False

    def update_connector_output(self, connector_output: Any) -> None:
        super().update_connector_output(connector_output)
        meta = shim.worker_metadata(connector_output)
        if isinstance(meta, LMCompactWorkerMetadata):
            self.on_load_failures(self._scheduler().take_report(meta.report))

    def on_load_failures(self, req_ids: set[str]) -> None:
        """Requests whose loads the worker refused (vLLM recomputes them); a hook for
        subclasses that track holes of their own."""

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        scheduler = self._scheduler()
        scheduler.after_alloc(request, num_external_tokens)
        start = scheduler.compacted_load_start(request.request_id)
        if start is not None and self.cache_guard is not None:
            # vLLM hashed the load's blocks in allocate_slots; they will hold kept rows, and
            # the rest of the request attends to them: unhash before any other lookup
            self.cache_guard.freeze(request.request_id, start // self.facts.block_size)

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        # vLLM >= 0.32 (its base implementation then calls bind_gpu_block_pool)
        self.bind_cache_guard(kv_cache_manager)
        super().bind_kv_cache_manager(kv_cache_manager)

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        super().bind_gpu_block_pool(gpu_block_pool)
        if self.cache_guard is not None or not self.facts.prefix_caching:
            return
        # vLLM 0.26 hands over only the pool; its owner is the scheduler's manager
        manager = shim.kv_cache_manager_owning(gpu_block_pool)
        if manager is None:
            raise RuntimeError(
                f"{type(self).__name__} could not find the KVCacheManager that owns the block "
                f"pool (vLLM {shim.vllm_version()}), so it cannot keep compacted blocks out "
                "of vLLM's prefix cache; start vLLM with enable_prefix_caching=False"
            )
        self.bind_cache_guard(manager)

    def bind_cache_guard(self, kv_cache_manager: Any) -> None:
        """With vLLM's prefix caching on, keep compacted blocks out of its cache
        (:class:`connectors.memory.blocks.PrefixCacheGuard`)."""
        if self.cache_guard is None and self.facts.prefix_caching:
            self.cache_guard = PrefixCacheGuard(kv_cache_manager)
            self._scheduler().frontier_of = self.cache_guard.frontier

    def build_connector_meta(self, scheduler_output: Any) -> LMCompactMetadata:
        return LMCompactMetadata(self._scheduler().build_metadata(scheduler_output))

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._scheduler().finished(request.request_id)
        return False, None

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        # "piecewise": holes are cut inside attention calls, which full graphs skip;
        # "full": they are cut in the runner's input buffers (shim.hook_step_tables)
        graphs = extra_config.get("cuda_graphs") if isinstance(extra_config, dict) else None
        return graphs != "full"

    @property
    def lmcompact_step_editor(self) -> WorkerHalf | None:
        """The worker half when it cuts holes in the runner's buffers (runner hooks)."""
        worker = self.worker_half
        return worker if worker is not None and worker.cut_at_build else None
