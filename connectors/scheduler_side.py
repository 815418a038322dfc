"""Scheduler half of the connector: finds stored prefixes and plans loads, captures, saves.

Cheap and side-effect free towards the engine: it reads the store's index (and fetches the
chunks of a hit, validating them, so a damaged or foreign entry becomes a shorter match and
the tokens are recomputed; the worker never meets a bad chunk), and describes each step's
work in one :class:`~connectors.metadata.StepMetadata`.

Packed load of ``n`` chunks of ``C`` tokens keeping ``K`` each, starting at token ``s``::

    logical tokens  s ........................ s+n*C | computed by vLLM ->
    slots           [ kept c0 | kept c1 | .. ][ hole: (C-K)*n tokens ][ tail .. ]
                    s          s+K         s+n*K                    s+n*C

Sliding-window layers also skip slots ``[0, s+(n-1)*K)`` (the hole's ``window_lead``): only
the last chunk's kept rows (its last K tokens) sit at their logical distance from the tail.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from connectors import vllm_shim as shim
from connectors.config import ConnectorConfig
from connectors.holes import Hole
from connectors.metadata import CaptureSpec, LoadSpec, SaveSpec, StepMetadata
from lmcompact.store import ChunkKey, ChunkKeyer, CompactedChunk, TieredStore

logger = logging.getLogger(__name__)


@dataclass
class _Tracked:
    """What the scheduler half remembers about one live request."""

    prompt: list[int]
    keys: list[ChunkKey]
    block_ids: list[int] = field(default_factory=list)
    pending: list[CompactedChunk] | None = None
    pending_start: int = 0
    confirmed: bool = False
    loaded_end: int = 0
    hole: Hole | None = None
    saved: bool = False


class SchedulerHalf:
    """Decides loads and saves for every request; talks to the store's index only."""

    def __init__(
        self,
        config: ConnectorConfig,
        facts: shim.EngineFacts,
        store: TieredStore,
        keyer: ChunkKeyer,
    ) -> None:
        self.config = config
        self.facts = facts
        self.store = store
        self.keyer = keyer
        self.kept = config.kept_per_chunk(facts.block_size)
        self._requests: dict[str, _Tracked] = {}
        self.stats = {"lookups": 0, "hit_chunks": 0, "rejected_chunks": 0}

    # ------------------------------------------------------------------ lookups
    def _track(self, request: Any) -> _Tracked:
        req_id = request.request_id
        tracked = self._requests.get(req_id)
        if tracked is None:
            prompt = shim.request_prompt_ids(request)
            tracked = _Tracked(prompt=prompt, keys=self.keyer.keys(prompt))
            self._requests[req_id] = tracked
        return tracked

    def num_new_matched_tokens(self, request: Any, num_computed: int) -> int:
        """Tokens beyond ``num_computed`` that stored chunks cover (0 when none)."""
        tracked = self._track(request)
        tracked.pending, tracked.confirmed = None, False
        c = self.config.chunk_size
        if not self.config.load or num_computed % c:
            return 0
        first = num_computed // c
        last = (len(tracked.prompt) - 1) // c  # leave >= 1 token for vLLM to compute
        if last <= first:
            return 0
        self.stats["lookups"] += 1
        try:
            present = self.store.lookup_prefix(tracked.keys[:last])
            found = self.store.get_many(tracked.keys[first:present]) if present > first else []
        except Exception:  # the store answers misses for faults; this is a last guard
            logger.exception("store lookup failed for %s; recomputing", request.request_id)
            return 0
        chunks: list[CompactedChunk] = []
        for index, chunk in enumerate(found):
            problem = "missing" if chunk is None else self._problem(chunk)
            if problem is not None:
                if chunk is not None:
                    self.stats["rejected_chunks"] += 1
                    logger.warning(
                        "rejecting stored chunk %d of %s (%s); recomputing from it",
                        first + index,
                        request.request_id,
                        problem,
                    )
                break
            assert chunk is not None
            chunks.append(chunk.clone())  # tiers hand out views; loads happen a step later
        if not chunks:
            return 0
        tracked.pending, tracked.pending_start = chunks, num_computed
        self.stats["hit_chunks"] += len(chunks)
        return len(chunks) * c

    def _problem(self, chunk: CompactedChunk) -> str | None:
        """Why ``chunk`` cannot be loaded into this engine, or None."""
        f = self.facts
        expected = (
            f.num_layers,
            f.num_kv_heads,
            f.head_dim,
            f.head_dim,
            f.dtype,
            self.config.chunk_size,
            self.kept,
        )
        got = (
            chunk.num_layers,
            chunk.num_kv_heads,
            chunk.keys.shape[1],
            chunk.values.shape[1],
            chunk.dtype,
            chunk.num_tokens,
            chunk.uniform_count(),
        )
        if got != expected:
            return f"shape/dtype/kept {got} != expected {expected}"
        pos = chunk.positions
        if pos.numel() and (int(pos.min()) < 0 or int(pos.max()) >= chunk.num_tokens):
            return "positions outside the chunk"
        return None

    def after_alloc(self, request: Any, num_external_tokens: int) -> None:
        tracked = self._track(request)
        tracked.confirmed = num_external_tokens > 0 and tracked.pending is not None
        if not tracked.confirmed:
            tracked.pending = None

    # -------------------------------------------------------------- step planning
    def build_metadata(self, scheduler_output: Any) -> StepMetadata:
        meta = StepMetadata()
        for sched in shim.scheduled_requests(scheduler_output):
            tracked = self._requests.get(sched.req_id)
            if tracked is None:
                if sched.prompt_token_ids is None:
                    continue
                tracked = _Tracked(
                    prompt=sched.prompt_token_ids, keys=self.keyer.keys(sched.prompt_token_ids)
                )
                self._requests[sched.req_id] = tracked
            if sched.replace:
                tracked.block_ids = list(sched.new_block_ids)
                self._start(sched, tracked, meta)
            else:
                tracked.block_ids.extend(sched.new_block_ids)
            if tracked.hole is not None:
                meta.holes[tracked.hole.first_block] = tracked.hole
            self._plan_save(sched, tracked, meta)
        for req_id in shim.preempted_req_ids(scheduler_output):
            if req_id in self._requests:
                self._requests[req_id].hole = None
        meta.finished = shim.finished_req_ids(scheduler_output)
        for req_id in meta.finished:
            self._requests.pop(req_id, None)
        return meta

    def _start(self, sched: shim.ScheduledRequest, tracked: _Tracked, meta: StepMetadata) -> None:
        """A request got (new) blocks: emit its load, if confirmed, and its hole."""
        c, bs = self.config.chunk_size, self.facts.block_size
        tracked.hole = None
        tracked.loaded_end = sched.num_computed - sched.num_computed % c
        if not (tracked.confirmed and tracked.pending):
            tracked.pending = None
            return
        chunks, start = tracked.pending, tracked.pending_start
        tracked.pending, tracked.confirmed = None, False
        meta.loads.append(LoadSpec(sched.req_id, list(tracked.block_ids), start, chunks))
        tracked.loaded_end = start + len(chunks) * c
        hole_tokens = len(chunks) * (c - self.kept)
        logger.info(
            "loaded %s from the store: %d prefix tokens as %d kept per (layer, head)%s",
            sched.req_id,
            len(chunks) * c,
            len(chunks) * self.kept,
            " (compacted)" if hole_tokens else "",
        )
        if hole_tokens:
            tracked.hole = Hole(
                first_block=tracked.block_ids[0],
                start_block=(start + len(chunks) * self.kept) // bs,
                num_blocks=hole_tokens // bs,
                window_lead=(start + (len(chunks) - 1) * self.kept) // bs,
            )

    def _plan_save(
        self, sched: shim.ScheduledRequest, tracked: _Tracked, meta: StepMetadata
    ) -> None:
        """Window captures in the steps that compute the prompt's last tokens; the save in
        the step that completes the prompt."""
        if not self.config.save or tracked.saved:
            return
        c, bs = self.config.chunk_size, self.facts.block_size
        prompt_len = len(tracked.prompt)
        lo, hi = sched.num_computed, min(sched.num_computed + sched.num_scheduled, prompt_len)
        window_lo = max(prompt_len - self.config.window, lo)
        if self.config.window and window_lo < hi:
            positions = list(range(window_lo, hi))
            slots = [tracked.block_ids[p // bs] * bs + p % bs for p in positions]
            meta.captures.append(CaptureSpec(sched.req_id, slots, positions))
        if hi < prompt_len:
            return
        tracked.saved = True
        n_full = prompt_len // c
        first = tracked.loaded_end // c
        if first < n_full:
            try:
                first = max(first, self.store.lookup_prefix(tracked.keys[:n_full]))
            except Exception:
                logger.exception("store lookup failed while planning a save")
        if first >= n_full:
            return
        meta.saves.append(
            SaveSpec(
                req_id=sched.req_id,
                block_ids=list(tracked.block_ids),
                keys=tracked.keys[first:n_full],
                start=first * c,
                num_tokens=prompt_len - first * c,
            )
        )

    def finished(self, req_id: str) -> None:
        self._requests.pop(req_id, None)
