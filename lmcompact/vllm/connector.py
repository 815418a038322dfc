"""``LMCompactConnector``: the vLLM v1 KV connector of lmcompact, one class with option groups.

Load it with::

    --kv-transfer-config '{"kv_connector": "LMCompactConnector",
                           "kv_connector_module_path": "lmcompact.vllm.connector",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"policy": "snapkv", "budget": 0.5}}'

or ``LLM(..., kv_transfer_config=KVTransferConfig(...))``. Options
(:class:`lmcompact.vllm.config.ConnectorConfig`): the policy, the ``store`` group (compacted
prefixes saved to and loaded from the tiers; on by default) and the ``release`` group
(prompts packed in place, dropped blocks given back to vLLM; off unless given). Any
combination works. Each role composes its halves:

* scheduler: :class:`lmcompact.vllm.scheduler_side.SchedulerHalf` (store lookups, loads, saves;
  it owns the one :class:`~lmcompact.vllm.request_state.RequestState` per request, holes
  included) and, with ``release``, :class:`lmcompact.vllm.memory.scheduler_side.
  MemoryScheduler` (packs, decode budget, hole blocks back to the pool), which reads and
  writes the same records;
* worker: :class:`lmcompact.vllm.worker_side.WorkerHalf` (loads, captures, saves, hole cuts)
  and, with ``release``, :class:`lmcompact.vllm.memory.release_worker.ReleaseWorker` (packs).

The halves talk only through :class:`~lmcompact.vllm.envelopes.LMCompactMetadata` (ids and
block numbers, never KV) and :class:`~lmcompact.vllm.envelopes.LMCompactWorkerMetadata`
(both importable from here too); each rank's store namespace comes from
:func:`lmcompact.vllm.store_registry.build_namespace`. ``LMCompactMemoryConnector`` is the
old name of this class with ``release`` on by default.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from lmcompact.store import ChunkKeyer, TieredStore
from lmcompact.vllm import vllm_shim as shim
from lmcompact.vllm.config import ConnectorConfig
from lmcompact.vllm.engine_checks import validate_against_engine
from lmcompact.vllm.envelopes import LMCompactMetadata, LMCompactWorkerMetadata
from lmcompact.vllm.memory.blocks import PrefixCacheGuard
from lmcompact.vllm.memory.heavy_hitters import HeavyHitterScores
from lmcompact.vllm.memory.perhead_attention import PerHeadAttention
from lmcompact.vllm.memory.planner import HolePlanner
from lmcompact.vllm.memory.release import make_planner, refuse_under_tensor_parallel
from lmcompact.vllm.memory.release_worker import ReleaseWorker
from lmcompact.vllm.memory.scheduler_side import MemoryScheduler, needs_scores
from lmcompact.vllm.scheduler_side import SchedulerHalf
from lmcompact.vllm.store_registry import STORE_LAYOUT, STORES, build_namespace
from lmcompact.vllm.worker_side import WorkerHalf

logger = logging.getLogger(__name__)

__all__ = [
    "STORE_LAYOUT",
    "LMCompactConnector",
    "LMCompactMemoryConnector",
    "LMCompactMetadata",
    "LMCompactWorkerMetadata",
    "build_namespace",
]


class LMCompactConnector(shim.KVConnectorBase_V1):  # type: ignore[misc]
    """KV-cache compaction connector (scheduler and worker roles, store and release)."""

    release_by_default = False
    """Whether the ``release`` group is on when the options do not name it."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        shim.share_engine_logging()  # our INFO lines in the engine's log, in every process
        self.config = ConnectorConfig.from_extra(
            shim.transfer_extra_config(vllm_config), release=self.release_by_default
        )
        self.facts = shim.engine_facts(vllm_config)
        validate_against_engine(
            self.config,
            block_size=self.facts.block_size,
            num_layers=self.facts.num_layers,
            num_kv_heads=self.facts.num_kv_heads,
            head_dim=self.facts.head_dim,
        )
        self.planner: HolePlanner | None = None  # with release: the shared hole geometry
        if self.config.release is not None:
            refuse_under_tensor_parallel(self.config.release, self.facts.tp_size)
            max_len = int(vllm_config.model_config.max_model_len)
            self.planner = make_planner(self.config, self.facts.block_size, max_len)
        # the worker's values carry its rank's namespace (a slice of another rank is refused
        # as foreign); chunk keys are derived in rank 0's, then per rank (ChunkKey.for_rank)
        self.tp_rank = 0 if role == shim.KVConnectorRole.SCHEDULER else shim.tp_rank()
        self.namespace = build_namespace(self.config, self.facts, self.tp_rank)
        self.store: TieredStore = STORES.acquire(self.namespace, self.config.store.store_config())
        self.scheduler_half: SchedulerHalf | None = None
        self.worker_half: WorkerHalf | None = None
        self.memory_scheduler: MemoryScheduler | None = None  # scheduler side, release
        self.release_worker: ReleaseWorker | None = None  # worker side, release
        self.cache_guard: PrefixCacheGuard | None = None  # scheduler side, prefix caching
        if self.config.store.load and not shim.recomputes_failed_loads(vllm_config):
            logger.warning(
                "kv_load_failure_policy is 'fail': a stored chunk that is missing or damaged "
                "when the worker loads it fails its request; set kv_load_failure_policy to "
                "'recompute' in --kv-transfer-config to recompute such requests instead"
            )
        self._rank_stores: list[TieredStore] = []  # scheduler, tensor parallel: ranks 1..
        if role == shim.KVConnectorRole.SCHEDULER:
            shim.track_kv_cache_managers()  # vLLM 0.26 binds only the manager's pool, later
            self._make_scheduler_halves()
        else:
            self.worker_half = WorkerHalf(
                self.config, self.facts, vllm_config, self.store, tp_rank=self.tp_rank
            )
            if self.planner is not None:
                self.release_worker = ReleaseWorker(self.config, self.planner, self.worker_half)
        self._log_start(role)

    def _make_scheduler_halves(self) -> None:
        keyer = ChunkKeyer(self.namespace, self.config.store.chunk_size)
        self._rank_stores = [
            STORES.acquire(
                build_namespace(self.config, self.facts, rank),
                self.config.store.store_config(),
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
        if self.planner is None or self.config.release is None:
            return
        # one hole per request, in its one record: the planner opens and grows them there
        self.planner.holes = self.scheduler_half.states.holes
        self.memory_scheduler = MemoryScheduler(
            self.planner,
            self.scheduler_half.states,
            self.facts.block_size,
            self.config.window,
            capture=not self.config.store.save,  # else the save path captures the window
            needs_scores=needs_scores(self.config.make_policy()),
            reserve_growth=self.config.release.reserve_growth,
            tp_size=self.facts.tp_size,
        )

    def _log_start(self, role: Any) -> None:
        store = self.config.store
        logger.info(
            "LMCompactConnector %s (tp rank %d of %d): policy=%s budget=%s chunk=%d tiers=%s "
            "save=%s load=%s vllm=%s",
            role,
            self.tp_rank,
            self.facts.tp_size,
            self.config.policy,
            self.config.budget,
            store.chunk_size,
            list(store.tiers),
            store.save,
            store.load,
            shim.vllm_version(),
        )
        release = self.config.release
        if release is None or self.planner is None:
            return
        logger.info(
            "LMCompactConnector %s release: prefill=%s decode_budget=%s decode_policy=%s sinks=%d",
            role,
            self.planner.prefill_mode.value,
            release.decode_budget_tokens,
            release.decode_policy,
            release.sink_blocks,
        )
        if self.facts.prefix_caching and self.config.compacts:
            logger.info(
                "prefix caching on: packs leave the blocks vLLM's cache served (or another "
                "request shares) untouched and compact the rest; compacted blocks are never "
                "hashed; shared blocks in a hole stay held until the request ends"
            )

    def _worker(self) -> WorkerHalf:
        if self.worker_half is None:
            raise RuntimeError("worker-side call on the scheduler connector")
        return self.worker_half

    def _scheduler(self) -> SchedulerHalf:
        if self.scheduler_half is None:
            raise RuntimeError("scheduler-side call on the worker connector")
        return self.scheduler_half

    # ------------------------------------------------- release worker, old attribute names
    @property
    def perhead(self) -> PerHeadAttention | None:
        if self.release_worker is not None and self.release_worker.perhead is not None:
            return self.release_worker.perhead
        return None if self.worker_half is None else self.worker_half.perhead

    @property
    def heavy(self) -> HeavyHitterScores | None:
        return None if self.release_worker is None else self.release_worker.heavy

    @property
    def pack_stats(self) -> dict[str, float] | None:
        return None if self.release_worker is None else self.release_worker.stats

    def pack_timings(self) -> dict[str, list[float]]:
        """Milliseconds per in-place pack (:meth:`ReleaseWorker.pack_timings`)."""
        if self.release_worker is None:
            return {"host": [], "device": []}
        return self.release_worker.pack_timings()

    # ------------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker().register_kv_caches(kv_caches)
        if self.release_worker is not None:
            self.release_worker.register()

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        super().bind_connector_metadata(connector_metadata)
        if not isinstance(connector_metadata, LMCompactMetadata):
            raise TypeError(f"expected LMCompactMetadata, got {type(connector_metadata)!r}")
        self._worker().begin_step(connector_metadata.step)
        if self.release_worker is not None:
            meta = connector_metadata
            self.release_worker.begin_step(
                meta.step.holes, meta.forgotten, meta.merges, meta.scored
            )

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
        meta = self._connector_metadata if self.has_connector_metadata() else None
        packs = meta.packs if isinstance(meta, LMCompactMetadata) else []
        release = self.release_worker
        # windows first: the save path takes the queries of a request it saves
        windows = release.windows(packs) if release is not None and packs else {}
        self._worker().wait_for_save()  # copies pages before they are packed
        if release is not None and packs:
            release.pack(packs, windows)

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
        if not isinstance(meta, LMCompactWorkerMetadata):
            return
        self._scheduler().take_report(meta.report)  # a refused load's hole is dropped
        if self.memory_scheduler is not None:
            self.memory_scheduler.confirm_packs(meta.report.packed)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        scheduler = self._scheduler()
        scheduler.after_alloc(request, num_external_tokens)
        start = scheduler.compacted_load_start(request.request_id)
        if start is not None and self.cache_guard is not None:
            # vLLM hashed the load's blocks in allocate_slots; they will hold kept rows, and
            # the rest of the request attends to them: unhash before any other lookup
            self.cache_guard.freeze(request.request_id, start // self.facts.block_size)

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        # vLLM >= 0.32 (its base implementation then calls bind_gpu_block_pool, which finds
        # everything bound)
        if self.memory_scheduler is not None:
            self.memory_scheduler.bind(kv_cache_manager)
        self.bind_cache_guard(kv_cache_manager)
        super().bind_kv_cache_manager(kv_cache_manager)

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        super().bind_gpu_block_pool(gpu_block_pool)
        memory = self.memory_scheduler
        wants_guard = self.cache_guard is None and self.facts.prefix_caching
        wants_ledger = memory is not None and memory.ledger is None
        if wants_guard or wants_ledger:
            # vLLM 0.26 hands over only the pool; its owner is the scheduler's manager
            manager = shim.kv_cache_manager_owning(gpu_block_pool)
            if manager is None:
                raise RuntimeError(
                    f"{type(self).__name__} could not find the KVCacheManager that owns the "
                    f"block pool (vLLM {shim.vllm_version()}), so it can neither keep "
                    "compacted blocks out of vLLM's prefix cache nor give blocks back; start "
                    'vLLM with enable_prefix_caching=False and without the "release" group'
                )
            self.bind_cache_guard(manager)
            if memory is not None and wants_ledger:
                memory.bind(manager)
        if memory is not None:
            memory.guard = self.cache_guard

    def bind_cache_guard(self, kv_cache_manager: Any) -> None:
        """With vLLM's prefix caching on, keep compacted blocks out of its cache
        (:class:`lmcompact.vllm.memory.blocks.PrefixCacheGuard`)."""
        if self.cache_guard is None and self.facts.prefix_caching:
            self.cache_guard = PrefixCacheGuard(kv_cache_manager)
        if self.memory_scheduler is not None:
            self.memory_scheduler.guard = self.cache_guard

    def build_connector_meta(self, scheduler_output: Any) -> LMCompactMetadata:
        scheduler = self._scheduler()
        step = scheduler.build_metadata(scheduler_output)
        memory = self.memory_scheduler
        packs = [] if memory is None else memory.plan_step(scheduler_output, step)
        guard = self.cache_guard
        scheduler.end_step(step, None if guard is None else guard.frontier)
        if memory is None:
            return LMCompactMetadata(step)
        merges = memory.take_merges()
        if packs or merges or not step.is_idle():
            # holes, captures and loads must be in place before the forward pass; vLLM
            # otherwise starts connector loads after it
            scheduler_output.has_sync_kv_loads = True
        return LMCompactMetadata(step, packs, memory.take_forgotten(), merges, dict(memory.scored))

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._scheduler().finished(request.request_id)
        return False, None

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        # "piecewise": holes are cut inside attention calls, which full graphs skip;
        # "full": they are cut in the runner's input buffers (shim.hook_step_tables), except
        # for per-head counts and H2O decode, which work inside every attention call
        try:
            config = ConnectorConfig.from_extra(extra_config, release=cls.release_by_default)
        except ValueError:
            return True  # the connector refuses these options when it is built
        return config.needs_piecewise

    @property
    def lmcompact_step_editor(self) -> WorkerHalf | None:
        """The worker half when it cuts holes in the runner's buffers (runner hooks)."""
        worker = self.worker_half
        return worker if worker is not None and worker.cut_at_build else None


class LMCompactMemoryConnector(LMCompactConnector):
    """The old name of :class:`LMCompactConnector` with the ``release`` group on by default
    (its options were the ``"memory"`` group, still accepted). Kept for one release."""

    release_by_default = True
