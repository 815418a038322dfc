"""The worker side of the ``"release"`` group: packs prompts in place, per-head attention and
H2O decode scores (one per worker, composed by :class:`lmcompact.vllm.connector.
LMCompactConnector` with its :class:`lmcompact.vllm.worker_side.WorkerHalf`).

The scheduler side (:class:`lmcompact.vllm.memory.scheduler_side.MemoryScheduler`) plans each
pack and names it in the step metadata; here, after the step's forward pass (and after the
store path copied the pages it saves), the kept tokens of each planned prompt are written
into its first blocks, with the observation-window queries the worker half captured
(:meth:`lmcompact.vllm.worker_side.WorkerHalf.window_queries`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import torch

from lmcompact.kernels import dispatch as kernels
from lmcompact.vllm import vllm_shim as shim
from lmcompact.vllm.config import ConnectorConfig
from lmcompact.vllm.memory.device_pack import DevicePacker
from lmcompact.vllm.memory.heavy_hitters import (
    HeavyHitterScores,
    MergeJob,
    make_heavy_hitter_scores,
)
from lmcompact.vllm.memory.packing import WindowQueries, pack_in_place
from lmcompact.vllm.memory.perhead_attention import PerHeadAttention, make_perhead_attention
from lmcompact.vllm.memory.planner import HolePlanner, PrefillMode
from lmcompact.vllm.memory.scheduler_side import PackJob, needs_scores
from lmcompact.vllm.worker_side import WorkerHalf

logger = logging.getLogger(__name__)


class ReleaseWorker:
    """Runs the step's in-place packs on one worker (one tensor-parallel rank).

    Args:
        config: the connector options (its ``release`` group is set).
        planner: the hole geometry shared with the scheduler side.
        worker: the worker half whose KV caches and captured queries this uses.
    """

    def __init__(self, config: ConnectorConfig, planner: HolePlanner, worker: WorkerHalf) -> None:
        assert config.release is not None
        self.config = config
        self.release = config.release
        self.planner = planner
        self.worker = worker
        self.policy = config.make_policy()
        self.perhead: PerHeadAttention | None = None  # with release.per_head
        self.heavy: HeavyHitterScores | None = None  # with decode_policy h2o
        self.device_packer: DevicePacker | None = None  # CUDA
        self.warm_up_s: list[tuple[int, float]] = []
        self.stats: dict[str, float] = {
            "packs": 0,
            "tokens": 0,
            "seconds": 0.0,
            "unscored": 0,
            "device_packs": 0,
        }
        # per pack: host seconds of its launches, and CUDA events around its device work
        self._pack_times: list[tuple[float, Any, Any]] = []

    # ------------------------------------------------------------------ set-up
    def register(self) -> None:
        """The worker half registered its KV caches: build what runs inside attention."""
        self._refuse_with_sliding_layers()
        if self.planner.per_head_slack is not None:
            self.perhead = make_perhead_attention(self.worker)
        if self.planner.decode_recent_blocks is not None:
            self.heavy = make_heavy_hitter_scores(self.worker)
        if self.perhead is not None or self.heavy is not None:
            # both read this step's holes inside attention layers, on uncut metadata
            self.worker.cut_at_build = False
        self._make_device_packer()

    def _make_device_packer(self) -> None:
        """Pack on the GPU when the caches are there and the policy has a device scorer;
        compile and autotune its kernels now (``release.warm_up``), not at the first
        request."""
        worker = self.worker
        layers = list(worker.kv_caches.values())
        if (
            not layers
            or self.planner.prefill_mode is not PrefillMode.PACK
            or self.perhead is not None
            or worker.layout.name != "token_major"
            or not kernels.use_kernels(layers[0].device)
            or not DevicePacker.supports(self.policy)
        ):
            return
        if worker.sliding_layers:
            # the device pack selects by score on every layer; sliding-window layers must
            # keep their most recent tokens (plan_pack's recent_layers): the reference packs
            logger.info("device pack off: the model has sliding-window layers")
            return
        first = next(iter(worker.layers.values()))
        self.device_packer = DevicePacker(
            layers, worker.facts.block_size, shim.attention_scale(first)
        )
        if self.release.warm_up:
            began = time.perf_counter()
            max_len = int(worker.vllm_config.model_config.max_model_len)
            self.warm_up_s = self.device_packer.warm_up(
                self.policy,
                shim.num_query_heads(first),
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
        distance (:mod:`lmcompact.vllm.holes`) need every head of a sliding layer to hold one
        contiguous run of recent tokens. Per-head counts (padding masked by a second
        attention pass without a window) and H2O decode (heavy hitters merged into the kept
        region, scored without a window) break that.
        """
        sliding = sorted(self.worker.sliding_layers)
        if not sliding:
            return
        g = self.release.group
        refused = []
        if self.planner.per_head_slack is not None:
            refused.append(f"{g}.per_head (per-head counts)")
        if self.planner.decode_recent_blocks is not None:
            refused.append(f"{g}.decode_policy 'h2o'")
        if refused:
            raise ValueError(
                f"{' and '.join(refused)} cannot be exact on a model with sliding-window "
                f"layers ({len(sliding)} of {len(self.worker.layers)} here): vLLM masks their "
                "window by key index, which these modes do not keep equal to the logical "
                "distance. Use a uniform policy (per_head off) and decode_policy 'recent'"
            )

    # ------------------------------------------------------------------ per step
    def begin_step(
        self,
        holes: Any,
        forgotten: set[str],
        merges: list[MergeJob],
        scored: dict[int, str],
    ) -> None:
        """The step's metadata was bound (before any load or forward pass of the step)."""
        if self.perhead is not None:
            self.perhead.begin_step(holes, forgotten)
        if self.heavy is not None:
            # merges read blocks vLLM took back in this step's schedule: before any load or
            # forward pass of the step can write them
            self.heavy.begin_step(merges, scored, forgotten)

    def windows(self, packs: Sequence[PackJob]) -> dict[str, WindowQueries | None]:
        """The captured window of each planned pack; read before the store path's save
        takes the queries of a request it saves."""
        return {job.req_id: self._window(job.req_id) for job in packs}

    def pack(self, packs: Sequence[PackJob], windows: dict[str, WindowQueries | None]) -> None:
        """Run the step's packs (after its forward pass and the store path's page copy)."""
        layers = list(self.worker.kv_caches.values())
        for job in packs:
            began = time.perf_counter()
            window = windows[job.req_id]
            if self.device_packer is not None and (
                window is not None or not needs_scores(self.policy)
            ):
                self._device_pack(job, window, began)
                continue
            if window is None and needs_scores(self.policy):
                # the policy then falls back to its score-free choice: count it, never hide it
                self.stats["unscored"] += 1
                logger.warning(
                    "pack of %s without window queries: %s chose without attention scores",
                    job.req_id,
                    self.config.policy,
                )
            chosen = pack_in_place(
                layers,
                self.worker.layout,
                job.block_ids,
                job.num_tokens,
                job.kept,
                self.policy,
                window,
                reserved=None if self.perhead is None else job.reserved,
                recent_layers=self.worker.sliding_layers,
                start=job.start,
            )
            if self.perhead is not None:
                counts = torch.tensor([[int(k.numel()) for k in heads] for heads in chosen])
                self.perhead.add(job.req_id, job.block_ids[0], counts, job.reserved)
            self._done(job, time.perf_counter() - began)
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

    def _device_pack(self, job: PackJob, window: WindowQueries | None, began: float) -> None:
        """One pack on the GPU, timed by CUDA events (read later, no sync here)."""
        assert self.device_packer is not None
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        queries = None
        if window is not None:  # (L, W, Hq, D) -> (L, Hq, W, D)
            queries = torch.stack(window.per_layer).permute(0, 2, 1, 3)
        first = job.start // self.worker.facts.block_size  # shared blocks stay as they are
        self.device_packer.pack(
            job.block_ids[first:],
            job.num_tokens,
            job.kept,
            self.policy,
            queries,
            None if window is None else window.positions - job.start,
        )
        end.record()
        host = time.perf_counter() - began
        self._done(job, host)  # launched: later kernels on the stream see it
        self.stats["device_packs"] += 1
        self._pack_times.append((host, start, end))

    def _done(self, job: PackJob, seconds: float) -> None:
        self.worker.forget_window(job.req_id)
        self.worker.report_packed(job.req_id)
        self.stats["packs"] += 1
        self.stats["tokens"] += job.num_tokens
        self.stats["seconds"] += seconds

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
        window = self.worker.window_queries(req_id)
        if window is None:
            return None
        first = next(iter(self.worker.layers.values()))
        return WindowQueries(
            per_layer=window[0],
            positions=torch.tensor(window[1], dtype=torch.int64),
            scale=shim.attention_scale(first),
        )
