"""A worker's saves: copy a request's pages off the forward path, compact and store them.

:class:`ChunkSaving` is a part of :class:`lmcompact.vllm.worker_side.WorkerHalf` (a mixin:
it reads the half's store, policy, caches and counters, declared below).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future

import torch

from lmcompact.attention.rope import Rope
from lmcompact.policies import CompactionPolicy
from lmcompact.vllm import vllm_shim as shim
from lmcompact.vllm.compaction import SaveJob, compact_job, full_nbytes
from lmcompact.vllm.metadata import SaveSpec
from lmcompact.vllm.reconstruct import ReconstructScores
from lmcompact.vllm.worker_state import WorkerState

logger = logging.getLogger(__name__)


class ChunkSaving(WorkerState):
    """Save specs of a step -> a copy of their pages now, compaction and store in the background."""

    policy: CompactionPolicy
    rope: Rope | None
    _pending: list[Future[None]]
    _recon: dict[str, ReconstructScores]

    def _copy_job(self, spec: SaveSpec) -> SaveJob:
        """Copy whole pages and the collected queries: the only work on the forward path."""
        bs = self.facts.block_size
        first, last = spec.start // bs, (spec.start + spec.num_tokens + bs - 1) // bs
        index = torch.tensor(spec.block_ids[first:last], dtype=torch.int64)
        pages = [kv[index.to(kv.device)].to("cpu") for kv in self.kv_caches.values()]
        window = self.window_queries(spec.req_id)
        self.forget_window(spec.req_id)
        queries = None
        query_positions = None
        context_scores = None
        if spec.reconstruct:
            context_scores = self._reconstruction_scores(spec, pages)
        elif spec.token_scores is not None:
            given = torch.tensor(spec.token_scores[: spec.num_tokens], dtype=torch.float32)
            context_scores = [given.expand(self.facts.num_kv_heads, -1) for _ in pages]
        elif window is not None:
            queries = [q.float().cpu() for q in window[0]]
            query_positions = torch.tensor(window[1], dtype=torch.int64)
        first_layer = next(iter(self.layers.values()))
        return SaveJob(
            spec.req_id,
            self.slice_keys(spec.keys),
            spec.start,
            spec.num_tokens,
            pages,
            queries,
            query_positions,
            shim.attention_scale(first_layer),
            window=self.config.window,
            rope=self.rope,
            context_scores=context_scores,
        )

    def _reconstruction_scores(
        self, spec: SaveSpec, pages: list[torch.Tensor]
    ) -> list[torch.Tensor]:
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
            return [torch.zeros(h, spec.num_tokens) for _ in pages]
        span = slice(spec.start, spec.start + spec.num_tokens)
        return [
            torch.zeros(h, spec.num_tokens) if s is None else s[:h, span] for s in recon.per_layer()
        ]

    def _run_job(self, job: SaveJob) -> None:
        try:
            began = time.perf_counter()
            items = compact_job(
                job,
                self.layout,
                self.policy,
                self.config.store.chunk_size,
                self.kept,
                recent_layers=self.sliding_layers,
            )
            elapsed = time.perf_counter() - began
            stored = self.store.put_many(items)
            with self._lock:
                for (key, _), ok in zip(items, stored, strict=True):
                    (self._report.saved if ok else self._report.save_failed).add(key)
                self.stats["saves"] += 1
                self.stats["saved_chunks"] += sum(stored)
                self.stats["compact_s"] += elapsed
                self.stats["compact_tokens"] += len(items) * self.config.store.chunk_size
                for (_, chunk), ok in zip(items, stored, strict=True):
                    if ok:
                        self.stats["bytes_stored"] += chunk.payload_nbytes
                        self.stats["bytes_full"] += full_nbytes(chunk, self.facts.head_dim)
            logger.info(
                "stored %s: %d/%d chunks, kept %d of %d tokens per (layer, head) (%s), %.3f s",
                job.req_id,
                sum(stored),
                len(items),
                len(items) * self.kept,
                len(items) * self.config.store.chunk_size,
                self.config.policy,
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
