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
from lmcompact.store.transfer import CopierPool, PendingCopy
from lmcompact.vllm import vllm_shim as shim
from lmcompact.vllm.compaction import SaveJob, compact_job, full_nbytes, window_masses
from lmcompact.vllm.metadata import SaveSpec
from lmcompact.vllm.reconstruct import ReconstructScores
from lmcompact.vllm.worker_state import WorkerState

logger = logging.getLogger(__name__)


class ChunkSaving(WorkerState):
    """Save specs of a step -> a copy of their pages now, compaction and store in the background."""

    policy: CompactionPolicy
    rope: Rope | None
    _pending: list[Future[None]]
    _pending_bytes: int
    _save_copiers: CopierPool
    _recon: dict[str, ReconstructScores]

    def _copy_job(self, spec: SaveSpec) -> SaveJob:
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
            shim.attention_scale(first_layer),
            window=self.config.window,
            rope=self.rope,
            context_scores=context_scores,
        )
        # on the GPU the window scores cost milliseconds there and seconds on the host
        masses = window_masses(job, self.layout, self.policy) if caches[0].is_cuda else None
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
        copies, pending = copier.to_host([tensors[i] for i in on_cuda])
        for i, copy in zip(on_cuda, copies, strict=True):
            out[i] = copy
        return out, pending

    def _reconstruction_scores(self, spec: SaveSpec, num_layers: int) -> list[torch.Tensor]:
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

    def _backlog_full(self, spec: SaveSpec) -> bool:
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
                "stored %s: %d/%d chunks, kept %d of %d tokens per (layer, head)%s (%s), %.3f s",
                job.req_id,
                sum(stored),
                len(items),
                len(items) * self.kept,
                len(items) * self.config.store.chunk_size,
                "" if self.cap is None else " on average",
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
