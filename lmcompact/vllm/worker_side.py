"""Worker half of the connector: executes one :class:`StepMetadata` per engine step.

Per step::

    start_load_kv   fetch and verify the step's chunks, write them into blocks (packed);
                    a load with a missing or bad chunk is not written: its blocks are
                    reported to vLLM (recomputed) and to the scheduler half;
                    find capture rows, swap per-layer attention metadata for copies that
                    skip holes
    attention       (patched) copy the queries of capture rows (the observation window and
                    the policy's sample across the prompt), per layer
    wait_for_save   copy the pages of finished prefills; compaction and store puts run
                    on a background thread, so the forward pass waits only for the copy

The worker keeps no request state except queries collected for a save still to come.
After each step it reports what it stored and loaded (:class:`WorkerReport`).

Tensor parallel: each rank runs one worker half over its own KV heads (``facts.num_kv_heads``
is the rank's count) and the queries of its own query heads, so scores, plans and stored
rows are per rank; kept counts per chunk are the config's, equal on every rank, so the
block tables the scheduler planned hold for all of them. A rank stores and loads its slice
under ``key.for_rank(rank, tp_size)`` and reports those slice keys.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from lmcompact.policies import Need
from lmcompact.store import ChunkKey, TieredStore
from lmcompact.store.transfer import CopierPool
from lmcompact.vllm import vllm_shim as shim
from lmcompact.vllm.config import ConnectorConfig
from lmcompact.vllm.kv_layout import PageLayout, make_layout
from lmcompact.vllm.memory.perhead_attention import PerHeadAttention, make_perhead_attention
from lmcompact.vllm.metadata import (
    ReconstructCapture,
    StepMetadata,
    WorkerReport,
)
from lmcompact.vllm.reconstruct import ReconstructScores
from lmcompact.vllm.worker_load import ChunkLoading
from lmcompact.vllm.worker_save import ChunkSaving
from lmcompact.vllm.worker_tables import TableCutting

logger = logging.getLogger(__name__)

AttentionObserver = Callable[[str, torch.Tensor, Any, torch.Tensor], None]
"""``observer(layer_name, query, attn_metadata, output)`` after every patched attention."""


class WorkerHalf(TableCutting, ChunkLoading, ChunkSaving):
    """Loads, captures and saves KV for one worker (one tensor-parallel rank)."""

    def __init__(
        self,
        config: ConnectorConfig,
        facts: shim.EngineFacts,
        vllm_config: Any,
        store: TieredStore,
        tp_rank: int = 0,
    ) -> None:
        self.config = config
        self.facts = facts
        self.tp_rank = tp_rank
        self.vllm_config = vllm_config
        self.store = store
        self.policy = config.store_policy()  # `none` when chunks are stored whole
        rotates = self.policy.needs & (Need.WINDOW_QUERIES | Need.CONTEXT_SCORES)
        self.rope = shim.rope_of(vllm_config) if rotates else None
        self.kept = config.kept_per_chunk(facts.block_size)
        self.slots = config.slots_per_chunk(facts.block_size)
        self.cap = self.slots if config.store.per_head is not None else None
        self.perhead: PerHeadAttention | None = None  # made at register (store.per_head)
        self.layout: PageLayout = make_layout(facts.layout_name, facts.block_size)
        self.kv_caches: dict[str, torch.Tensor] = {}
        self.layers: dict[str, Any] = {}
        self.layer_index: dict[str, int] = {}
        self.windows: dict[str, int | None] = {}  # sliding window per layer (None: full)
        self.observers: list[AttentionObserver] = []
        self._meta: StepMetadata | None = None
        self._prepared = False
        self._edited: dict[tuple[int, bool], Any] = {}  # (id(metadata), sliding) -> copy
        # Holes cut in the runner's input buffers (shim.hook_step_tables), which is where
        # full CUDA graphs read them; otherwise per layer in the metadata (_skip_holes).
        self.full_graphs = False
        self.cut_at_build = False
        self._staged: StepMetadata | None = None
        self._cut_for: StepMetadata | None = None  # the step edit_tables last served
        self._stage_seen = False  # the runner hook runs (V2 GPU runner)
        self._forward_expected = True  # the staged step runs a forward pass
        self._capture_rows: dict[str, torch.Tensor] = {}
        self._captured: dict[str, list[list[torch.Tensor]]] = {}
        self._captured_pos: dict[str, list[int]] = {}
        # reconstruction passes: this step's rows, positions and spec; running scores
        self._recon_rows: dict[str, tuple[torch.Tensor, torch.Tensor, ReconstructCapture]] = {}
        self._recon: dict[str, ReconstructScores] = {}
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lmcompact-save")
        self._pending: list[Future[None]] = []
        self._save_copiers = CopierPool()  # CUDA: page copies to the host on a side stream
        self._pending_bytes = 0  # page copies held by queued background saves
        self._lock = threading.Lock()
        self._report = WorkerReport()
        self._load_errors: set[int] = set()
        self.stats: dict[str, float] = {
            "loads": 0,
            "loaded_chunks": 0,
            "load_failures": 0,
            "rejected_chunks": 0,
            "saves": 0,
            "saves_skipped": 0,
            "saved_chunks": 0,
            "bytes_stored": 0,
            "bytes_full": 0,
            "compact_s": 0.0,
            "compact_tokens": 0,
            "save_errors": 0,
            "capture_specs": 0,  # window captures asked for / found in the batch
            "captures_found": 0,
            "reconstruct_s": 0.0,  # scoring reconstruction passes on the forward path
            "reconstruct_queries": 0,
            "eager_capture_steps": 0,  # steps run without full graphs to capture queries
            "rows_cut_in_buffers": 0,
        }

    # ------------------------------------------------------------------ set-up
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.layers = shim.attention_layers(self.vllm_config)
        missing = [name for name in self.layers if name not in kv_caches]
        if missing:
            raise ValueError(f"no KV cache registered for attention layers {missing[:3]}")
        self.kv_caches = {name: kv_caches[name] for name in self.layers}
        self.layer_index = {name: i for i, name in enumerate(self.layers)}
        if len(self.layers) != self.facts.num_layers:
            raise ValueError(
                f"found {len(self.layers)} attention layers, the model config says "
                f"{self.facts.num_layers}"
            )
        first = next(iter(self.layers))
        shim.check_page_layout(self.facts, self.kv_caches[first], self.layers[first])
        for name, layer in self.layers.items():
            shim.wrap_attention_forward(name, layer, self._before_attention, self._after_attention)
        self.windows = {name: shim.sliding_window(layer) for name, layer in self.layers.items()}
        self._log_sliding()
        self._choose_hole_cutting()
        if self.cap is not None:
            self._start_per_head_loads()
        logger.info(
            "LMCompactConnector worker: %d layers, layout %s, policy %s, kept %d/%d per chunk",
            len(self.layers),
            self.layout.name,
            self.config.policy,
            self.kept,
            self.config.store.chunk_size,
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
        self.perhead = make_perhead_attention(self)
        # it reads this step's holes inside attention, on uncut metadata (as release does)
        self.cut_at_build = False

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
        if self.config.store_compacts and self.kept < smallest:  # whole chunks lose nothing
            logger.warning(
                "kept %d tokens per chunk < sliding window %d: after a store load, sliding "
                "layers see only the last %d tokens of the loaded prefix (exact masking, "
                "fewer tokens); a budget keeping >= %d tokens per chunk loses nothing there",
                self.kept,
                smallest,
                self.kept,
                smallest,
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

    def report_packed(self, req_id: str) -> None:
        """An in-place pack of ``req_id`` ran on this rank (its hole may be released once
        every rank says so)."""
        with self._lock:
            self._report.packed.add((req_id, self.tp_rank))

    # ------------------------------------------------------------------ per step
    def begin_step(self, meta: StepMetadata) -> None:
        """The step's metadata was bound (always before its forward pass)."""
        self._meta = meta
        self._prepared = False
        self._edited = {}
        if self.perhead is not None:
            self.perhead.begin_step(meta.holes, meta.finished | meta.taken_back)

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
        for load in meta.loads:
            self._load(load)
        per_layer = shim.forward_metadata(forward_context)
        self._capture_rows = self._find_capture_rows(meta, per_layer)
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

    def _find_capture_rows(
        self, meta: StepMetadata, per_layer: dict[str, Any]
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
        slots = shim.slot_mapping(next(iter(per_layer.values()))).to("cpu", torch.int64)
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

    def _skip_holes(self, meta: StepMetadata, per_layer: dict[str, Any]) -> None:
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
                self._edited[key] = shim.apply_holes(
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
            self.prepare(shim.current_forward_context())
        key = (id(attn_metadata), self.windows.get(name) is not None)
        return self._edited.get(key, attn_metadata)

    def _after_attention(
        self, name: str, layer: Any, query: torch.Tensor, attn_metadata: Any, output: torch.Tensor
    ) -> None:
        if self._capture_rows:
            index = self.layer_index[name]
            for req_id, rows in self._capture_rows.items():
                q = query.view(query.shape[0], -1, self.facts.head_dim)[rows.to(query.device)]
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
            keys, _ = self.layout.read(
                self.kv_caches[name], spec.block_ids, 0, int(positions.max()) + 1
            )
            self._recon[req_id].observe(
                index, q, positions.to(keys.device), keys, shim.attention_scale(layer)
            )
            if index == 0:
                self.stats["reconstruct_queries"] += positions.numel()
        self.stats["reconstruct_s"] += time.perf_counter() - began

    def wait_for_save(self) -> None:
        meta, self._meta = self._meta, None
        self._capture_rows = {}
        self._recon_rows = {}
        self._edited = {}
        if meta is None or not self._prepared:
            return
        for spec in meta.saves:
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

    def shutdown(self) -> None:
        self.drain()
        self._executor.shutdown(wait=True)
