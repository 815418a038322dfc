"""Scheduler half of the connector: finds stored prefixes and plans loads, captures, saves.

Cheap and free of store I/O on the engine's scheduling loop: it asks which chunks exist
(:mod:`lmcompact.vllm.scheduler_lookup`) and describes each step's work in one
:class:`~lmcompact.vllm.metadata.StepMetadata` that names chunks by key (captures and saves:
:mod:`lmcompact.vllm.scheduler_saves`). The worker half fetches and verifies them; a chunk
that turns out missing or bad there is reported back and the request is recomputed (vLLM's
``kv_load_failure_policy`` "recompute"), never loaded wrong. Each live request has one
:class:`~lmcompact.vllm.request_state.RequestState`.

Packed load of ``n`` chunks of ``C`` tokens keeping ``K`` each, starting at token ``s``::

    logical tokens  s ........................ s+n*C | computed by vLLM ->
    slots           [ kept c0 | kept c1 | .. ][ hole: (C-K)*n tokens ][ tail .. ]
                    s          s+K         s+n*K                    s+n*C

Sliding-window layers also skip slots ``[0, s+(n-1)*K)`` (the hole's ``window_lead``): only
the last chunk's kept rows (its last K tokens) sit at their logical distance from the tail.

The half owns the scheduler side's one record per request
(:class:`~lmcompact.vllm.request_state.RequestStates`): the release group reads and writes
the same records (their holes above all), and :meth:`SchedulerHalf.end_step` sends every
scheduled request's visible hole to the worker, whoever opened it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from lmcompact.store import ChunkKey, ChunkKeyer, TieredStore
from lmcompact.vllm import vllm_shim as shim
from lmcompact.vllm.config import ConnectorConfig
from lmcompact.vllm.holes import keyed_by_last_block
from lmcompact.vllm.metadata import LoadSpec, StepMetadata
from lmcompact.vllm.request_state import HoleState, RequestState, RequestStates
from lmcompact.vllm.scheduler_lookup import StoreLookup
from lmcompact.vllm.scheduler_saves import SavePlanning
from lmcompact.vllm.scheduler_state import SchedulerState

logger = logging.getLogger(__name__)

__all__ = ["RequestState", "SchedulerHalf", "SchedulerState"]


class SchedulerHalf(StoreLookup, SavePlanning):
    """Decides loads and saves for every request; talks to the store's index only."""

    def __init__(
        self,
        config: ConnectorConfig,
        facts: shim.EngineFacts,
        store: TieredStore,
        keyer: ChunkKeyer,
        save_wait_s: float = 30.0,
        rank_stores: Sequence[TieredStore] | None = None,
    ) -> None:
        self.config = config
        self.facts = facts
        self.store = store
        # the index of each rank's slices (tiers such as Redis name entries by namespace,
        # which holds the rank): rank 0's is ``store``
        self.rank_stores = list(rank_stores) if rank_stores is not None else [store]
        if len(self.rank_stores) != facts.tp_size:
            raise ValueError(
                f"one store per tensor-parallel rank: got {len(self.rank_stores)} for "
                f"{facts.tp_size} ranks"
            )
        self.keyer = keyer
        self.slots = config.slots_per_chunk(facts.block_size)
        self.save_wait_s = save_wait_s
        self.policy = config.store_policy()  # what the saved chunks' compaction reads
        self.states = RequestStates()  # one record per live request, shared by the halves
        self._seq_lens: dict[str, int] = {}  # this step's scheduled requests -> key length
        self.tp_size = facts.tp_size
        self._reported: set[ChunkKey] = set()  # slice keys stored, as the workers said
        self._saving: dict[ChunkKey, float] = {}  # slice save planned -> time planned
        self._version = 0  # bumps whenever what is known to exist changes
        self.stats = {
            "lookups": 0,
            "store_queries": 0,
            "hit_chunks": 0,
            "waits": 0,
            "wait_timeouts": 0,
            "load_failures": 0,
        }

    # ------------------------------------------------------------------ requests
    def _track(self, request: Any) -> RequestState:
        req_id = request.request_id
        tracked = self.states.get(req_id)
        if tracked is None:
            prompt = shim.request_prompt_ids(request)
            tracked = RequestState(prompt=prompt, keys=self.keyer.keys(prompt))
            tracked.reconstruct = self._reconstruct_len(request, prompt)
            self._given_scores(request, tracked)
            self.states.add(req_id, tracked)
        return tracked

    # -------------------------------------------------------------- step planning
    def build_metadata(self, scheduler_output: Any) -> StepMetadata:
        """This step's loads, captures and saves (its holes: :meth:`end_step`)."""
        meta = StepMetadata()
        self._seq_lens = {}
        for sched in shim.scheduled_requests(scheduler_output):
            tracked = self.states.get(sched.req_id)
            if tracked is None:
                if sched.prompt_token_ids is None:
                    continue
                tracked = self.states.add(
                    sched.req_id,
                    RequestState(
                        prompt=sched.prompt_token_ids,
                        keys=self.keyer.keys(sched.prompt_token_ids),
                    ),
                )
            self._seq_lens[sched.req_id] = sched.num_computed + sched.num_scheduled
            if sched.replace:
                tracked.block_ids = list(sched.new_block_ids)
                self._start(sched, tracked, meta)
            else:
                tracked.block_ids.extend(sched.new_block_ids)
            self._plan_save(sched, tracked, meta)
        for req_id in shim.preempted_req_ids(scheduler_output):
            self.states.forget(req_id, finished=False)
            meta.taken_back.add(req_id)
        meta.finished = shim.finished_req_ids(scheduler_output)
        for req_id in meta.finished:
            self.states.forget(req_id, finished=True)
        return meta

    def end_step(
        self, meta: StepMetadata, frontier: Callable[[str], int | None] | None = None
    ) -> None:
        """Add the visible hole of every request scheduled this step to ``meta`` (whoever
        opened it: a compacted load, or the release group) and count the step.

        Args:
            frontier: with vLLM's prefix caching, the request's first block kept out of the
                cache (:meth:`lmcompact.vllm.memory.blocks.PrefixCacheGuard.frontier`;
                None: none); a hole of a request whose block 0 may be shared (frontier not
                0) is keyed by the row's last block instead.
        """
        step = self.states.step
        for req_id, seq_len in self._seq_lens.items():
            tracked = self.states.get(req_id)
            hole = None if tracked is None else tracked.hole
            if tracked is None or hole is None or hole.length == 0 or hole.visible_from > step:
                continue
            wire = hole.wire(req_id)
            if frontier is not None and frontier(req_id) != 0:
                wire = keyed_by_last_block(wire, tracked.block_ids, seq_len, self.facts.block_size)
            meta.holes[wire.first_block] = wire
        self.states.step += 1

    def _start(
        self, sched: shim.ScheduledRequest, tracked: RequestState, meta: StepMetadata
    ) -> None:
        """A request got (new) blocks: emit its load, if confirmed, and open its hole."""
        c, bs = self.config.store.chunk_size, self.facts.block_size
        tracked.drop_hole()
        # chunks vLLM's own prefix cache served hold the full KV in the request's blocks:
        # they are saved too (when the store lacks them), so a repeat finds them there
        # once vLLM's cache dropped them
        tracked.loaded_end = 0
        if not (tracked.confirmed and tracked.pending):
            tracked.pending = 0
            return
        count, start = tracked.pending, tracked.pending_start
        tracked.pending, tracked.confirmed = 0, False
        first = start // c
        keys = tracked.keys[first : first + count]
        meta.loads.append(LoadSpec(sched.req_id, list(tracked.block_ids), start, keys))
        self.stats["hit_chunks"] += count
        tracked.loaded_end = start + count * c
        tracked.load_start = start
        hole_tokens = count * (c - self.slots)
        logger.info(
            "loading %s from the store: %d prefix tokens as %d %s per (layer, head)%s",
            sched.req_id,
            count * c,
            count * self.slots,
            "slots (per-head counts, padded)" if self.config.store.per_head else "kept",
            " (compacted)" if hole_tokens else "",
        )
        if hole_tokens:
            # the release group gives its blocks back once the worker confirmed the load
            tracked.hole = HoleState(
                first_block=tracked.block_ids[0],
                start=(start + count * self.slots) // bs,
                length=hole_tokens // bs,
                visible_from=self.states.step,
                owned=False,
                window_lead=(start + (count - 1) * self.slots) // bs,
            )

    def finished(self, req_id: str) -> None:
        self.states.forget(req_id, finished=True)
