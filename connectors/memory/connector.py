"""``LMCompactMemoryConnector``: the compaction connector plus real memory saving.

Load it with::

    LLM(..., enable_prefix_caching=False,
        kv_transfer_config=KVTransferConfig(
            kv_connector="LMCompactMemoryConnector",
            kv_connector_module_path="connectors.memory.connector",
            kv_role="kv_both",
            kv_connector_extra_config={"policy": "snapkv", "budget": 0.25,
                                       "save": False, "load": False,
                                       "memory": {"prefill": "auto"}}))

On top of :class:`connectors.lmcompact_connector.LMCompactConnector` (store save/load,
hole skipping in attention), it compacts every fresh prompt in place when its prefill ends
and returns the dropped blocks to vLLM's pool, grows holes during long generations to keep a
request within a token budget (dropping the oldest block, or with ``"decode_policy": "h2o"``
merging it into a kept region of heavy hitters: :mod:`connectors.memory.heavy_hitters`),
and returns the hole blocks of packed store loads. With
``"per_head": {"slack": 1.5}`` each (layer, head) keeps the policy's own count (Ada-KV,
PyramidKV, DuoAttention) and attention masks the padding:
:mod:`connectors.memory.perhead_attention`.
Options: :class:`connectors.memory.config.MemoryConfig`.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from connectors import vllm_shim as shim
from connectors.lmcompact_connector import LMCompactConnector, LMCompactMetadata
from connectors.memory.config import split_extra
from connectors.memory.heavy_hitters import (
    HeavyHitterScores,
    MergeJob,
    make_heavy_hitter_scores,
)
from connectors.memory.packing import WindowQueries, pack_in_place
from connectors.memory.perhead_attention import PerHeadAttention, make_perhead_attention
from connectors.memory.planner import HolePlanner
from connectors.memory.scheduler_side import MemoryScheduler, PackJob, needs_scores
from connectors.metadata import StepMetadata
from lmcompact.policies import Need

logger = logging.getLogger(__name__)


class MemoryMetadata(LMCompactMetadata):
    """The base step metadata plus this step's in-place packs, the requests whose blocks
    vLLM took back since the last step (the worker drops their per-head counts and H2O
    scores), and H2O decode: merges to run before the forward pass and the requests whose
    decode attention is scored (first block -> request id)."""

    def __init__(
        self,
        step: StepMetadata,
        packs: list[PackJob],
        forgotten: set[str] | None = None,
        merges: list[MergeJob] | None = None,
        scored: dict[int, str] | None = None,
    ) -> None:
        super().__init__(step)
        self.packs = packs
        self.forgotten = forgotten or set()
        self.merges = merges or []
        self.scored = scored or {}


class LMCompactMemoryConnector(LMCompactConnector):
    """Compaction connector that gives dropped tokens' blocks back to vLLM."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        transfer = vllm_config.kv_transfer_config
        original = dict(transfer.kv_connector_extra_config or {})
        base_extra, self.memory = split_extra(original)
        self.per_head_counts = self.memory.per_head is not None
        transfer.kv_connector_extra_config = base_extra
        try:
            super().__init__(vllm_config, role, kv_cache_config)
        finally:
            transfer.kv_connector_extra_config = original
        bs = self.facts.block_size
        self.planner = HolePlanner(
            block_size=bs,
            prefill_mode=self.memory.prefill_mode(self.config.policy, self.config.compacts),
            budget=float(self.config.budget),
            sink_blocks=self.memory.sink_blocks,
            decode_budget_blocks=self.memory.decode_budget_blocks(bs),
            min_prompt_blocks=max(2, self.memory.min_prompt_tokens // bs),
            per_head_slack=self.memory.per_head_slack(),
            decode_recent_blocks=self.memory.decode_recent_blocks(bs),
        )
        if self.planner.decode_recent_blocks is not None and self.facts.prefix_caching:
            raise ValueError(
                "memory.decode_policy 'h2o' rewrites a request's kept blocks in place, which "
                "vLLM's prefix cache cannot represent: start vLLM with "
                "enable_prefix_caching=False"
            )
        self.perhead: PerHeadAttention | None = None  # worker side, with memory.per_head
        self.heavy: HeavyHitterScores | None = None  # worker side, with decode_policy h2o
        if self.planner.decode_budget_blocks is not None and self.facts.prefix_caching:
            logger.info(
                "decode budget with prefix caching on: shared or cached blocks in a "
                "hole stay held until the request ends"
            )
        self.memory_scheduler: MemoryScheduler | None = None
        self.pack_stats: dict[str, float] = {
            "packs": 0,
            "tokens": 0,
            "seconds": 0.0,
            "unscored": 0,
        }
        self._policy = self.config.make_policy()
        agnostic = self._policy.needs & (Need.CONTEXT_SCORES | Need.WINDOW_QUERIES)
        if agnostic and self.config.compacts and self.planner.prefill_mode.value == "pack":
            raise ValueError(
                f"policy {self.config.policy!r} reads {agnostic}, which the in-place pack does "
                "not capture; in place the question is inside the observation window, so use a "
                "query-aware policy there (snapkv, tova, knorm); kvzip and expected_attention "
                "are for prefixes stored by LMCompactConnector"
            )
        if self.scheduler_half is not None:
            self.memory_scheduler = MemoryScheduler(
                self.planner,
                bs,
                self.config.window,
                capture=not self.config.save,
                needs_scores=needs_scores(self._policy),
            )
        logger.info(
            "LMCompactMemoryConnector %s: prefill=%s decode_budget=%s decode_policy=%s sinks=%d",
            role,
            self.planner.prefill_mode.value,
            self.memory.decode_budget_tokens,
            self.memory.decode_policy,
            self.memory.sink_blocks,
        )

    # --------------------------------------------------------------- scheduler side
    def _memory(self) -> MemoryScheduler:
        if self.memory_scheduler is None:
            raise RuntimeError("scheduler-side call on the worker connector")
        return self.memory_scheduler

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        # vLLM >= 0.32: the manager itself (its base implementation then calls
        # bind_gpu_block_pool, which finds the manager already bound)
        self._memory().bind(kv_cache_manager)
        super().bind_kv_cache_manager(kv_cache_manager)

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        super().bind_gpu_block_pool(gpu_block_pool)
        memory = self._memory()
        if memory.ledger is not None:
            return
        # vLLM 0.26 hands over only the pool; its owner is the scheduler's manager
        manager = shim.kv_cache_manager_owning(gpu_block_pool)
        if manager is None:
            raise RuntimeError(
                "LMCompactMemoryConnector could not find the KVCacheManager that owns the "
                f"block pool (vLLM {shim.vllm_version()}); use LMCompactConnector instead"
            )
        memory.bind(manager)

    def build_connector_meta(self, scheduler_output: Any) -> MemoryMetadata:
        step = super().build_connector_meta(scheduler_output).step
        memory = self._memory()
        packs = memory.plan_step(scheduler_output, step)
        merges = memory.take_merges()
        if packs or merges or not step.is_idle():
            # holes, captures and loads must be in place before the forward pass; vLLM
            # otherwise starts connector loads after it
            scheduler_output.has_sync_kv_loads = True
        return MemoryMetadata(step, packs, memory.take_forgotten(), merges, dict(memory.scored))

    # ------------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        super().register_kv_caches(kv_caches)
        if self.planner.per_head_slack is not None:
            self.perhead = make_perhead_attention(self._worker())
        if self.planner.decode_recent_blocks is not None:
            self.heavy = make_heavy_hitter_scores(self._worker())

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        super().bind_connector_metadata(connector_metadata)
        if not isinstance(connector_metadata, MemoryMetadata):
            return
        if self.perhead is not None:
            self.perhead.begin_step(connector_metadata.step.holes, connector_metadata.forgotten)
        if self.heavy is not None:
            # merges read blocks vLLM took back in this step's schedule: before any load or
            # forward pass of the step can write them
            self.heavy.begin_step(
                connector_metadata.merges, connector_metadata.scored, connector_metadata.forgotten
            )

    def wait_for_save(self) -> None:
        meta = self._connector_metadata if self.has_connector_metadata() else None
        packs = meta.packs if isinstance(meta, MemoryMetadata) else []
        windows = {job.req_id: self._window(job.req_id) for job in packs}
        super().wait_for_save()  # the base save path copies pages before they are packed
        worker = self._worker()
        layers = list(worker.kv_caches.values())
        for job in packs:
            began = time.perf_counter()
            if windows[job.req_id] is None and needs_scores(self._policy):
                # the policy then falls back to its score-free choice: count it, never hide it
                self.pack_stats["unscored"] += 1
                logger.warning(
                    "pack of %s without window queries: %s chose without attention scores",
                    job.req_id,
                    self.config.policy,
                )
            chosen = pack_in_place(
                layers,
                worker.layout,
                job.block_ids,
                job.num_tokens,
                job.kept,
                self._policy,
                windows[job.req_id],
                reserved=None if self.perhead is None else job.reserved,
            )
            if self.perhead is not None:
                counts = torch.tensor([[int(k.numel()) for k in heads] for heads in chosen])
                self.perhead.add(job.req_id, job.block_ids[0], counts, job.reserved)
            worker._captured.pop(job.req_id, None)
            worker._captured_pos.pop(job.req_id, None)
            self.pack_stats["packs"] += 1
            self.pack_stats["tokens"] += job.num_tokens
            self.pack_stats["seconds"] += time.perf_counter() - began
            logger.debug("packed %s: %d -> %d tokens", job.req_id, job.num_tokens, job.kept)

    def _window(self, req_id: str) -> WindowQueries | None:
        worker = self._worker()
        captured = worker._captured.get(req_id)
        positions = worker._captured_pos.get(req_id)
        if not captured or not positions or not all(captured):
            return None
        first = next(iter(worker.layers.values()))
        return WindowQueries(
            per_layer=[torch.cat(parts).float() for parts in captured],
            positions=torch.tensor(positions, dtype=torch.int64),
            scale=float(first.impl.scale),
        )
