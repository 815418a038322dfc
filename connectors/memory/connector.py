"""``LMCompactMemoryConnector``: the compaction connector plus real memory saving.

Load it with::

    LLM(..., kv_transfer_config=KVTransferConfig(
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
from connectors.config import BUDGET_TOLERANCE
from connectors.lmcompact_connector import LMCompactConnector, LMCompactMetadata
from connectors.memory.config import split_extra
from connectors.memory.device_pack import DevicePacker
from connectors.memory.heavy_hitters import (
    HeavyHitterScores,
    MergeJob,
    make_heavy_hitter_scores,
)
from connectors.memory.packing import WindowQueries, pack_in_place
from connectors.memory.perhead_attention import PerHeadAttention, make_perhead_attention
from connectors.memory.planner import HolePlanner, PrefillMode
from connectors.memory.rank_packs import RankPacks
from connectors.memory.scheduler_side import MemoryScheduler, PackJob, needs_scores
from connectors.metadata import StepMetadata
from lmcompact.kernels import dispatch as kernels
from lmcompact.policies import Need

logger = logging.getLogger(__name__)

PACK_UNSUPPORTED = Need.CONTEXT_SCORES | Need.WINDOW_QUERIES
"""Inputs :func:`connectors.memory.packing.plan_pack` does not compute."""


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

    packs_in_place = True

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
        prefill_mode = self.memory.prefill_mode(self.config.policy, self.config.compacts)
        if (
            self.config.compacts
            and self.config.compact_on == "load"
            and prefill_mode is PrefillMode.OFF
        ):
            raise ValueError(
                "compact_on 'load' stores prefixes whole and compacts them in the loading "
                "request's prefill: memory.prefill must be 'pack', 'blocks' or 'auto', got 'off'"
            )
        unpackable = self.config.make_policy().needs & PACK_UNSUPPORTED
        if self.config.compacts and prefill_mode is PrefillMode.PACK and unpackable:
            raise ValueError(
                f"policy {self.config.policy!r} needs {unpackable}, which the in-place pack "
                "does not compute (it scores with keys and the window's attention); use it on "
                "the store path (compact_on 'save', memory.prefill 'off') or pack with "
                "snapkv, knorm, tova, streaming_llm"
            )
        self.planner = HolePlanner(
            block_size=bs,
            prefill_mode=prefill_mode,
            budget=float(self.config.budget),
            sink_blocks=self.memory.sink_blocks,
            decode_budget_blocks=self.memory.decode_budget_blocks(bs),
            min_prompt_blocks=max(2, self.memory.min_prompt_tokens // bs),
            per_head_slack=self.memory.per_head_slack(),
            decode_recent_blocks=self.memory.decode_recent_blocks(bs),
        )
        self._check_pack_geometry(int(vllm_config.model_config.max_model_len))
        self._refuse_under_tensor_parallel()
        self.perhead: PerHeadAttention | None = None  # worker side, with memory.per_head
        self.heavy: HeavyHitterScores | None = None  # worker side, with decode_policy h2o
        if self.facts.prefix_caching and self.config.compacts:
            logger.info(
                "prefix caching on: packs leave the blocks vLLM's cache served (or another "
                "request shares) untouched and compact the rest; compacted blocks are never "
                "hashed; shared blocks in a hole stay held until the request ends"
            )
        self.memory_scheduler: MemoryScheduler | None = None
        self.pack_stats: dict[str, float] = {
            "packs": 0,
            "tokens": 0,
            "seconds": 0.0,
            "unscored": 0,
            "device_packs": 0,
        }
        self.device_packer: DevicePacker | None = None  # worker side, CUDA
        self.warm_up_s: list[tuple[int, float]] = []
        self.rank_packs = RankPacks(self.facts.tp_size)  # scheduler side, pack reports
        # per pack: host seconds of its launches, and CUDA events around its device work
        self._pack_times: list[tuple[float, Any, Any]] = []
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
                reserve_growth=self.memory.reserve_growth,
            )
            # an adopted store-load hole goes back only once the worker wrote the load, a
            # packed prompt's hole (tensor parallel) once every rank packed it
            self.memory_scheduler.held_back = self._held_back
        logger.info(
            "LMCompactMemoryConnector %s: prefill=%s decode_budget=%s decode_policy=%s sinks=%d",
            role,
            self.planner.prefill_mode.value,
            self.memory.decode_budget_tokens,
            self.memory.decode_policy,
            self.memory.sink_blocks,
        )

    def _check_pack_geometry(self, max_model_len: int) -> None:
        if self.planner.prefill_mode is not PrefillMode.PACK:
            return
        honoured = pack_budget_honoured_from(self.planner, max_model_len)
        logger.info(
            "in-place packs keep whole blocks of %d tokens: budget %g is kept within %.0f%% "
            "for prompts of >= %s tokens; other lengths keep the nearest block count "
            "(each pack logs its kept / full tokens)",
            self.planner.block_size,
            self.planner.budget,
            100 * BUDGET_TOLERANCE,
            "no length up to max_model_len: only some" if honoured is None else honoured,
        )

    def _refuse_under_tensor_parallel(self) -> None:
        """Start-up refusal of the modes not made exact per tensor-parallel rank.

        Per-head counts are allocated over the heads a worker sees (a rank sees only its
        slice, so the allocation and the padded length would differ from one GPU's), and H2O
        decode merges were never checked across ranks; both are refused rather than run
        unverified. Uniform policies are per rank by construction: every (layer, head)
        keeps the same count, so one block table serves all ranks.
        """
        if self.facts.tp_size == 1:
            return
        refused = []
        if self.memory.per_head is not None:
            refused.append("memory.per_head (per-head counts)")
        if self.memory.decode_policy == "h2o":
            refused.append("memory.decode_policy 'h2o'")
        if refused:
            raise ValueError(
                f"{' and '.join(refused)} with tensor_parallel_size {self.facts.tp_size}: "
                "not supported under tensor parallelism (each rank sees only its KV heads); "
                "use a uniform policy without per_head and decode_policy 'recent', or "
                "tensor_parallel_size 1"
            )

    # --------------------------------------------------------------- scheduler side
    def _held_back(self, req_id: str) -> bool:
        """Whether ``req_id``'s hole blocks must stay held this step."""
        return self._scheduler().load_unconfirmed(req_id) or self.rank_packs.pending(req_id)

    def update_connector_output(self, connector_output: Any) -> None:
        super().update_connector_output(connector_output)
        report = getattr(shim.worker_metadata(connector_output), "report", None)
        if report is not None:
            self.rank_packs.confirm(report.packed)

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        self.rank_packs.drop(request.request_id)
        return super().request_finished(request, block_ids)

    def _memory(self) -> MemoryScheduler:
        if self.memory_scheduler is None:
            raise RuntimeError("scheduler-side call on the worker connector")
        return self.memory_scheduler

    def on_load_failures(self, req_ids: set[str]) -> None:
        for req_id in req_ids:
            self._memory().cancel_hole(req_id)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        # per-head counts and H2O decode work inside every attention call, decode included
        if super().requires_piecewise_for_cudagraph(extra_config):
            return True
        memory = extra_config.get("memory") if isinstance(extra_config, dict) else None
        if not isinstance(memory, dict):
            return False
        return memory.get("per_head") is not None or memory.get("decode_policy") == "h2o"

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        # vLLM >= 0.32: the manager itself (its base implementation then calls
        # bind_gpu_block_pool, which finds the manager already bound)
        self._memory().bind(kv_cache_manager)
        super().bind_kv_cache_manager(kv_cache_manager)
        self._memory().guard = self.cache_guard

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        super().bind_gpu_block_pool(gpu_block_pool)
        memory = self._memory()
        memory.guard = self.cache_guard
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
        for job in packs:  # its hole goes back once every rank reported the pack
            self.rank_packs.expect(job.req_id)
        merges = memory.take_merges()
        if packs or merges or not step.is_idle():
            # holes, captures and loads must be in place before the forward pass; vLLM
            # otherwise starts connector loads after it
            scheduler_output.has_sync_kv_loads = True
        return MemoryMetadata(step, packs, memory.take_forgotten(), merges, dict(memory.scored))

    # ------------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        super().register_kv_caches(kv_caches)
        self._refuse_with_sliding_layers()
        if self.planner.per_head_slack is not None:
            self.perhead = make_perhead_attention(self._worker())
        if self.planner.decode_recent_blocks is not None:
            self.heavy = make_heavy_hitter_scores(self._worker())
        if self.perhead is not None or self.heavy is not None:
            # both read this step's holes inside attention layers, on uncut metadata
            self._worker().cut_at_build = False
        self._make_device_packer()

    def _make_device_packer(self) -> None:
        """Pack on the GPU when the caches are there and the policy has a device scorer;
        compile and autotune its kernels now (``memory.warm_up``), not at the first request."""
        worker = self._worker()
        layers = list(worker.kv_caches.values())
        if (
            not layers
            or self.planner.prefill_mode is not PrefillMode.PACK
            or self.perhead is not None
            or worker.layout.name != "token_major"
            or not kernels.use_kernels(layers[0].device)
            or not DevicePacker.supports(self._policy)
        ):
            return
        if worker.sliding_layers:
            # the device pack selects by score on every layer; sliding-window layers must
            # keep their most recent tokens (plan_pack's recent_layers): the reference packs
            logger.info("device pack off: the model has sliding-window layers")
            return
        first = next(iter(worker.layers.values()))
        self.device_packer = DevicePacker(layers, self.facts.block_size, float(first.impl.scale))
        if self.memory.warm_up:
            began = time.perf_counter()
            max_len = int(worker.vllm_config.model_config.max_model_len)
            self.warm_up_s = self.device_packer.warm_up(
                self._policy,
                int(first.impl.num_heads),
                max(1, self.config.window),
                max_len,
                float(self.config.budget),
            )
            logger.info(
                "device pack ready: warm-up of %d lengths took %.1f s",
                len(self.warm_up_s),
                time.perf_counter() - began,
            )

    def _refuse_with_sliding_layers(self) -> None:
        """Start-up refusal of what cannot be exact with sliding-window layers.

        vLLM masks their window by key index; the exact ways to keep that index the logical
        distance (:mod:`connectors.holes`) need every head of a sliding layer to hold one
        contiguous run of recent tokens. Per-head counts (padding masked by a second
        attention pass without a window) and H2O decode (heavy hitters merged into the kept
        region, scored without a window) break that.
        """
        worker = self._worker()
        sliding = sorted(worker.sliding_layers)
        if not sliding:
            return
        refused = []
        if self.planner.per_head_slack is not None:
            refused.append("memory.per_head (per-head counts)")
        if self.planner.decode_recent_blocks is not None:
            refused.append("memory.decode_policy 'h2o'")
        if refused:
            raise ValueError(
                f"{' and '.join(refused)} cannot be exact on a model with sliding-window "
                f"layers ({len(sliding)} of {len(worker.layers)} here): vLLM masks their "
                "window by key index, which these modes do not keep equal to the logical "
                "distance. Use a uniform policy (per_head off) and decode_policy 'recent'"
            )

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
            if self.device_packer is not None and (
                windows[job.req_id] is not None or not needs_scores(self._policy)
            ):
                self._device_pack(job, windows[job.req_id], began)
                continue
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
                recent_layers=worker.sliding_layers,
                start=job.start,
            )
            if self.perhead is not None:
                counts = torch.tensor([[int(k.numel()) for k in heads] for heads in chosen])
                self.perhead.add(job.req_id, job.block_ids[0], counts, job.reserved)
            worker._captured.pop(job.req_id, None)
            worker._captured_pos.pop(job.req_id, None)
            worker.report_packed(job.req_id)
            self.pack_stats["packs"] += 1
            self.pack_stats["tokens"] += job.num_tokens
            self.pack_stats["seconds"] += time.perf_counter() - began
            logger.info(
                "compacted %s in place: kept %d of %d prompt tokens per (layer, head) (%s)%s",
                job.req_id,
                job.start + job.kept,
                job.start + job.num_tokens,
                self.config.policy,
                f"; its first {job.start} are shared through vLLM's prefix cache"
                if job.start
                else "",
            )
            self._pack_times.append((time.perf_counter() - began, None, None))
            logger.debug("packed %s: %d -> %d tokens", job.req_id, job.num_tokens, job.kept)

    def _device_pack(self, job: PackJob, window: WindowQueries | None, began: float) -> None:
        """One pack on the GPU, timed by CUDA events (read later, no sync here)."""
        assert self.device_packer is not None
        worker = self._worker()
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        queries = None
        if window is not None:  # (L, W, Hq, D) -> (L, Hq, W, D)
            queries = torch.stack(window.per_layer).permute(0, 2, 1, 3)
        first = job.start // self.facts.block_size  # shared blocks before it stay as they are
        self.device_packer.pack(
            job.block_ids[first:],
            job.num_tokens,
            job.kept,
            self._policy,
            queries,
            None if window is None else window.positions - job.start,
        )
        end.record()
        worker._captured.pop(job.req_id, None)
        worker._captured_pos.pop(job.req_id, None)
        worker.report_packed(job.req_id)  # launched: later kernels on the stream see it
        host = time.perf_counter() - began
        self.pack_stats["packs"] += 1
        self.pack_stats["device_packs"] += 1
        self.pack_stats["tokens"] += job.num_tokens
        self.pack_stats["seconds"] += host
        self._pack_times.append((host, start, end))

    def pack_timings(self) -> dict[str, list[float]]:
        """Milliseconds per pack so far, in order: ``host`` (launching, or the whole
        reference pack on the CPU) and ``device`` (GPU time between the pack's CUDA events;
        waits for them). A benchmark reads this once its requests are done."""
        host = [1e3 * h for h, _, _ in self._pack_times]
        device = []
        for h, start, end in self._pack_times:
            if start is None:
                device.append(1e3 * h)
            else:
                end.synchronize()
                device.append(float(start.elapsed_time(end)))
        return {"host": host, "device": device}

    def _window(self, req_id: str) -> WindowQueries | None:
        worker = self._worker()
        captured = worker._captured.get(req_id)
        positions = worker._captured_pos.get(req_id)
        if not captured or not positions or not all(captured):
            return None
        first = next(iter(worker.layers.values()))
        return WindowQueries(
            per_layer=[parts[0] if len(parts) == 1 else torch.cat(parts) for parts in captured],
            positions=torch.tensor(positions, dtype=torch.int64),
            scale=float(first.impl.scale),
        )


def pack_budget_honoured_from(planner: HolePlanner, max_model_len: int) -> int | None:
    """Prompt tokens from which every in-place pack keeps ``planner.budget`` within
    :data:`connectors.config.BUDGET_TOLERANCE` (None: only some lengths do).

    Packs keep whole blocks (``planner.kept_blocks``), so a prompt of ``F`` full blocks
    keeps about ``round(budget * F)``; short prompts cannot honour small budgets.

    Raises:
        ValueError: no prompt length up to ``max_model_len`` honours the budget.
    """
    budget, bs = planner.budget, planner.block_size
    lengths = range(planner.min_prompt_blocks, max_model_len // bs + 1)
    fine = [
        abs(planner.kept_blocks(nb) / nb - budget) <= BUDGET_TOLERANCE * budget for nb in lengths
    ]
    if not any(fine):
        largest = max(lengths.stop - 1, 1)
        raise ValueError(
            f"budget {budget:g} cannot be honoured by in-place packs of prompts up to "
            f"max_model_len {max_model_len} with block size {bs}: they keep whole blocks "
            f"(at best {planner.kept_blocks(largest)} of {largest}, "
            f"{planner.kept_blocks(largest) / largest:g}); raise the budget to at least "
            f"{1 / largest:g} or use a smaller block size"
        )
    if not fine[-1]:
        return None
    first = len(fine) - 1
    while first > 0 and fine[first - 1]:
        first -= 1
    return (lengths.start + first) * bs
