"""``LMCompactConnector``: the vLLM v1 KV connector of lmcompact.

Load it with::

    --kv-transfer-config '{"kv_connector": "LMCompactConnector",
                           "kv_connector_module_path": "connectors.vllm.connector",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"policy": "snapkv", "budget": 0.5}}'

or ``LLM(..., kv_transfer_config=KVTransferConfig(...))``. Options
(:class:`connectors.vllm.config.ConnectorConfig`): the policy, the ``store`` group (compacted
prefixes saved to and loaded from the tiers; on by default) and the ``release`` group
(prompts packed in place, dropped blocks given back to vLLM; off unless given).

This class is a facade, as vLLM's own offloading connector is: it builds the process's
:class:`~connectors.vllm.spec.ConnectorSpec` once, then one
:class:`~connectors.vllm.scheduler.Scheduler` or one :class:`~connectors.vllm.worker.Worker`
for its role, and delegates every API method to it. The two talk only through
:class:`~connectors.vllm.metadata.LMCompactMetadata` (ids and block numbers, never KV) and
:class:`~connectors.vllm.metadata.LMCompactWorkerMetadata`.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole

from connectors.vllm import stats
from connectors.vllm.config import ConnectorConfig
from connectors.vllm.metadata import LMCompactMetadata, LMCompactWorkerMetadata, worker_metadata
from connectors.vllm.patches import engine
from connectors.vllm.scheduler import Scheduler
from connectors.vllm.spec import ConnectorSpec
from connectors.vllm.stats import LMCompactPromMetrics, LMCompactStats
from connectors.vllm.worker import Worker
from lmcompact.store import TieredStore
from lmcompact.store.registry import STORES

logger = logging.getLogger(__name__)

__all__ = ["LMCompactConnector", "LMCompactMetadata", "LMCompactWorkerMetadata"]


class LMCompactConnector(KVConnectorBase_V1):  # type: ignore[misc]
    """KV-cache compaction connector (scheduler and worker roles, store and release)."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        engine.share_engine_logging()  # our INFO lines in the engine's log, in every process
        self.spec = ConnectorSpec.build(vllm_config)
        scheduler_role = role == KVConnectorRole.SCHEDULER
        # a worker's values carry its rank's namespace (another rank's slice is refused as
        # foreign); the scheduler reads every rank's index
        self.tp_rank = 0 if scheduler_role else engine.tp_rank()
        ranks = range(self.spec.facts.tp_size) if scheduler_role else [self.tp_rank]
        store_config = self.spec.config.store.store_config()
        self._stores: list[TieredStore] = [
            STORES.acquire(self.spec.namespaces[rank], store_config) for rank in ranks
        ]
        self.store = self._stores[0]
        self.scheduler: Scheduler | None = None
        self.worker: Worker | None = None
        self._counter_deltas = stats.CounterDeltas()
        if self.spec.config.store.load and not engine.recomputes_failed_loads(vllm_config):
            logger.warning(
                "kv_load_failure_policy is 'fail': a stored chunk that is missing or damaged "
                "when the worker loads it fails its request; set kv_load_failure_policy to "
                "'recompute' in --kv-transfer-config to recompute such requests instead"
            )
        if scheduler_role:
            self.scheduler = Scheduler(self.spec, self._stores)
        else:
            self.worker = Worker(self.spec, vllm_config, self.store, tp_rank=self.tp_rank)
        self._log_start(role)

    def _log_start(self, role: Any) -> None:
        config, facts = self.spec.config, self.spec.facts
        logger.info(
            "LMCompactConnector %s (tp rank %d of %d): policy=%s budget=%s chunk=%d tiers=%s "
            "save=%s load=%s vllm=%s",
            role,
            self.tp_rank,
            facts.tp_size,
            config.policy,
            config.budget,
            config.store.chunk_size,
            list(config.store.tiers),
            config.store.save,
            config.store.load,
            engine.vllm_version(),
        )
        release = config.release
        if release is None:
            return
        logger.info(
            "LMCompactConnector %s release: prefill=%s decode_budget=%s%s decode_policy=%s "
            "sinks=%d",
            role,
            config.release_mode.value,
            release.decode_budget_tokens,
            " (generated tokens; prompt kept)" if release.protect_prompt else "",
            release.decode_policy,
            release.sink_blocks,
        )
        if facts.prefix_caching and config.compacts:
            logger.info(
                "prefix caching on: packs leave the blocks vLLM's cache served (or another "
                "request shares) untouched and compact the rest; compacted blocks are never "
                "hashed; shared blocks in a hole stay held until the request ends"
            )

    def _worker(self) -> Worker:
        if self.worker is None:
            raise RuntimeError("worker-side call on the scheduler connector")
        return self.worker

    def _scheduler(self) -> Scheduler:
        if self.scheduler is None:
            raise RuntimeError("scheduler-side call on the worker connector")
        return self.scheduler

    # ------------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker().register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        super().bind_connector_metadata(connector_metadata)
        if not isinstance(connector_metadata, LMCompactMetadata):
            raise TypeError(f"expected LMCompactMetadata, got {type(connector_metadata)!r}")
        self._worker().begin_step(connector_metadata)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self._worker().prepare(forward_context)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # loads complete inside start_load_kv

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return None  # pages are copied once, after the last layer, in wait_for_save

    def wait_for_save(self) -> None:
        self._worker().wait_for_save()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker().take_load_errors()

    def build_connector_worker_meta(self) -> LMCompactWorkerMetadata | None:
        report = self._worker().take_report()
        return None if report is None else LMCompactWorkerMetadata(report)

    def get_kv_connector_stats(self) -> LMCompactStats | None:
        """This half's counter increases since its last report (None when none grew)."""
        if self.worker is not None:
            totals = stats.read_counters(self.worker, stats.WORKER_SOURCES)
        else:
            totals = stats.read_counters(self._scheduler(), stats.SCHEDULER_SOURCES)
        increases = self._counter_deltas.take(totals)
        return LMCompactStats(data=increases) if increases else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> LMCompactStats:
        return LMCompactStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> LMCompactPromMetrics:
        return LMCompactPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
        for store in self._stores:
            STORES.release(store)

    @property
    def lmcompact_hidden_observer(self) -> Worker | None:
        """The worker when it scores prompts by the model's own log-probabilities."""
        worker = self.worker
        return worker if worker is not None and worker.engine_scores else None

    @property
    def lmcompact_step_editor(self) -> Worker | None:
        """The worker when it cuts holes in the runner's buffers (runner hooks)."""
        worker = self.worker
        return worker if worker is not None and worker.cut_at_build else None

    # --------------------------------------------------------------- scheduler side
    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self._scheduler().num_new_matched_tokens(request, num_computed_tokens), False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._scheduler().after_alloc(request, num_external_tokens)

    def update_connector_output(self, connector_output: Any) -> None:
        super().update_connector_output(connector_output)
        meta = worker_metadata(connector_output)
        if isinstance(meta, LMCompactWorkerMetadata):
            self._scheduler().take_report(meta.report)

    def build_connector_meta(self, scheduler_output: Any) -> LMCompactMetadata:
        return self._scheduler().build_connector_meta(scheduler_output)

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        # a kv_producer's params tell the consumer what it stored (disaggregation.py)
        return False, self._scheduler().finished(request.request_id)

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        # vLLM >= 0.32 (its base implementation then calls bind_gpu_block_pool)
        self._scheduler().bind_manager(kv_cache_manager)
        super().bind_kv_cache_manager(kv_cache_manager)

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        super().bind_gpu_block_pool(gpu_block_pool)
        self._scheduler().bind_pool(gpu_block_pool)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        # "piecewise": holes are cut inside attention calls, which full graphs skip;
        # "full": they are cut in the runner's input buffers (patches/runner.py), except
        # for H2O decode, which works inside every attention call; "auto": full where the
        # engine being configured allows it (vLLM asks from VllmConfig.__post_init__)
        try:
            config = ConnectorConfig.from_extra(extra_config)
        except ValueError:
            return True  # the connector refuses these options when it is built
        if config.needs_piecewise:
            return True
        if config.cuda_graphs == "full":
            return False
        refusal = engine.full_graphs_refusal(engine.config_being_built())
        engine.share_engine_logging()  # no connector exists yet to have done it
        logger.info(
            'cuda_graphs "auto": %s',
            f"piecewise CUDA graphs ({refusal})"
            if refusal
            else "full CUDA graphs (holes cut in the runner's input buffers)",
        )
        return refusal is not None
