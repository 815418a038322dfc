"""Scheduler half of memory saving: opens holes, returns their blocks, plans packs.

The holes, and what was given back of them, live in each request's one
:class:`~lmcompact.vllm.request_state.RequestState` (the store half owns the records and
opens the holes of compacted loads there; this half releases those the same way).

Hooks into vLLM's ``KVCacheManager`` (given to connectors by ``bind_kv_cache_manager``)
by wrapping three methods of that one instance:

* ``allocate_slots(request, ...)``: before vLLM sizes a scheduled request's new blocks,
  return the blocks of its visible hole and grow the hole for the decode budget, so the
  freed blocks already count for this step's admissions (like vLLM's own
  ``remove_skipped_blocks``, which runs at the same point);
* ``free(request)`` and ``pop_blocks_for_free(request)``: vLLM is taking all the request's
  blocks back (finish, abort, preemption): forget its hole and what was released of it
  (:meth:`lmcompact.vllm.request_state.RequestStates.forget`). vLLM's own free then returns
  the blocks still held; the null entries of the hole are skipped by ``free_blocks``.

Timeline of one compacted prompt (step = one ``schedule()`` + forward)::

    step t     schedule: prompt completes -> Pack(req) in metadata, hole planned
               worker:   forward (full prompt) -> pack kept tokens into blocks [0, kb)
    step t+1   schedule: hole visible -> its blocks go back to the pool (null in the row)
               worker:   attention skips the hole (virtual block table)

A block released in schedule ``t+1`` can be handed to another request in that schedule
and written by forward ``t+1``, which runs after forward ``t`` (one stream, or the CPU),
so the pack in ``t`` has read it before anyone writes it.

Admission without thrash (``reserve_growth``): :mod:`lmcompact.vllm.memory.admission`.

H2O decode: a block that joins the hole in schedule ``t`` is released there too, but its
tokens are still needed; the :class:`lmcompact.vllm.memory.heavy_hitters.MergeJob` (with the
block's physical id, taken before the release) goes into step ``t``'s metadata and the
worker merges it when binding that metadata, before step ``t``'s loads and forward pass,
the first things that may write the block again.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from functools import wraps
from typing import Any

from lmcompact.vllm import vllm_shim as shim
from lmcompact.vllm.compaction import SCORE_NEEDS
from lmcompact.vllm.memory.admission import GrowthReserve
from lmcompact.vllm.memory.blocks import BlockLedger, PrefixCacheGuard
from lmcompact.vllm.memory.heavy_hitters import MergeJob
from lmcompact.vllm.memory.planner import HolePlanner
from lmcompact.vllm.memory.rank_packs import RankPacks
from lmcompact.vllm.memory.scheduler_state import MemorySchedulerState, MemoryStats, PackJob
from lmcompact.vllm.metadata import CaptureSpec, StepMetadata
from lmcompact.vllm.request_state import RequestState, RequestStates

logger = logging.getLogger(__name__)

__all__ = [
    "MemoryScheduler",
    "MemorySchedulerState",
    "MemoryStats",
    "PackJob",
    "needs_scores",
]


class MemoryScheduler(GrowthReserve):
    """Scheduler-side memory saving for one engine.

    Args:
        planner: hole geometry; its ``holes`` must be ``states.holes``.
        states: the scheduler side's one record per request (its hole, its release
            bookkeeping), owned by the store half (:class:`lmcompact.vllm.scheduler_side.
            SchedulerHalf`).
        block_size: tokens per block.
        window: observation-window queries to capture for score-based policies.
        capture: add window captures for packs (False when the base connector's save path
            already captures the same window).
        needs_scores: the policy reads window scores.
        reserve_growth: refuse admissions that would eat running requests' growth.
        tp_size: tensor-parallel ranks (a pack's hole goes back once every rank packed).
    """

    def __init__(
        self,
        planner: HolePlanner,
        states: RequestStates,
        block_size: int,
        window: int,
        capture: bool,
        needs_scores: bool,
        reserve_growth: bool = True,
        tp_size: int = 1,
    ) -> None:
        if planner.holes is not states.holes:
            raise ValueError("the planner must keep its holes in the request states")
        self.planner = planner
        self.states = states
        self.block_size = block_size
        self.window = window
        self.capture = capture and needs_scores and window > 0
        self.ledger: BlockLedger | None = None
        self.forgotten: set[str] = set()  # blocks taken back since the last step's metadata
        self.merges: list[MergeJob] = []  # H2O merges planned since the last step's metadata
        self.scored: dict[int, str] = {}  # H2O requests decoding this step: first block -> id
        self.reserve_growth = reserve_growth
        self.rank_packs = RankPacks(tp_size, states)  # pack reports some rank still owes
        self.stats = MemoryStats()
        # with vLLM's prefix caching: the guard keeping compacted blocks unhashed
        self.guard: PrefixCacheGuard | None = None

    @property
    def step(self) -> int:
        """The step being planned (counted by the store half, :meth:`SchedulerHalf.end_step`)."""
        return self.states.step

    # ------------------------------------------------------------------ binding
    def bind(self, kv_cache_manager: Any) -> None:
        """Start managing ``kv_cache_manager`` (wraps three of its methods, once)."""
        if getattr(kv_cache_manager, "_lmcompact_memory", None) is not None:
            raise ValueError("this KVCacheManager already has a memory manager bound")
        self.ledger = BlockLedger(kv_cache_manager)
        kv_cache_manager._lmcompact_memory = self
        allocate = kv_cache_manager.allocate_slots
        free = kv_cache_manager.free
        pop = getattr(kv_cache_manager, "pop_blocks_for_free", None)  # 0.32 deferred frees

        @wraps(allocate)
        def allocate_slots(request: Any, *args: Any, **kwargs: Any) -> Any:
            if not self.admits(request):
                return None  # vLLM keeps the request waiting, as when the pool is full
            self.before_allocate(request)
            return allocate(request, *args, **kwargs)

        @wraps(free)
        def free_request(request: Any) -> None:
            self.forget(request.request_id)
            free(request)

        kv_cache_manager.allocate_slots = allocate_slots
        kv_cache_manager.free = free_request
        if pop is not None:

            @wraps(pop)
            def pop_blocks_for_free(request: Any) -> Any:
                self.forget(request.request_id)
                return pop(request)

            kv_cache_manager.pop_blocks_for_free = pop_blocks_for_free

    # ------------------------------------------------------------------ hooks
    def before_allocate(self, request: Any) -> None:
        """A request is about to get blocks this step: release and grow its hole."""
        req_id = request.request_id
        ledger = self._ledger()
        self._state(req_id).request = request
        row = ledger.blocks(req_id)
        if not row:
            return
        processed = int(request.num_computed_tokens) - int(
            getattr(request, "num_in_flight_tokens", 0) or 0
        )
        before = self.planner.holes.get(req_id)
        old_stop = None if before is None else before.stop
        if processed >= int(request.num_prompt_tokens):
            self._claim_for_h2o(req_id, row)
        grown = self.planner.grow_for_decode(
            req_id, row[0].block_id, int(request.num_prompt_tokens), processed, self.step
        )
        hole = self.planner.holes.get(req_id)
        if grown and self.guard is not None:
            # from now on its tokens attend past a hole: not the full prefix's KV
            self.guard.freeze(req_id, processed // self.block_size)
        if grown and hole is not None and self.planner.decode_recent_blocks is not None:
            # a kept region of sinks only (a tiny prefill pack) has nothing to merge into
            first = hole.start if old_stop is None else old_stop
            if hole.start > self.planner.sink_blocks and self._h2o_owned(req_id):
                ids = [block.block_id for block in row]  # the merged blocks, before release
                self.merges.append(
                    MergeJob(
                        req_id,
                        tuple(ids[: hole.start]),
                        tuple(ids[first : hole.stop]),
                        self.planner.sink_blocks * self.block_size,
                    )
                )
        self._release(req_id)

    def _h2o_owned(self, req_id: str) -> bool:
        """H2O scores and merges for this request: always without prefix caching; with it,
        only once the request owns all its blocks, unhashed (:meth:`_claim_for_h2o`): merges
        rewrite its kept region, and its scored rows are found by block 0."""
        if self.planner.decode_recent_blocks is None:
            return False
        return self.guard is None or self.guard.frontier(req_id) == 0

    def _claim_for_h2o(self, req_id: str, row: list[Any]) -> None:
        """Prefix caching, H2O decode: when the request decodes and its first block is its
        own (no other request shares any of its blocks: sharing is by prefix), take every
        block out of the cache, so none can be shared later. A request that shares its
        first block decodes as with ``"recent"`` (no scores, no merges) until it owns it."""
        if self.guard is None or self.planner.decode_recent_blocks is None:
            return
        if self.guard.frontier(req_id) == 0 or not row or row[0].ref_cnt != 1:
            return
        self.guard.freeze(req_id, 0)

    def forget(self, req_id: str) -> None:
        """vLLM takes every block of ``req_id`` back (finish, abort, preemption)."""
        self.states.forget(req_id, finished=False)
        self.merges = [job for job in self.merges if job.req_id != req_id]
        self.forgotten.add(req_id)

    def confirm_packs(self, packed: Iterable[tuple[str, int]]) -> None:
        """Fold in the ranks' pack reports of a step (``(request id, rank)`` each)."""
        self.rank_packs.confirm(packed)

    def _state(self, req_id: str) -> RequestState:
        state = self.states.get(req_id)
        if state is None:
            raise RuntimeError(f"request {req_id!r} has blocks but no request state")
        return state

    def _held_back(self, state: RequestState, req_id: str) -> bool:
        """Whether ``req_id``'s hole blocks must stay held this step: a store load the
        worker has not confirmed (a refused one is recomputed into them), or a pack some
        tensor-parallel rank has not reported."""
        return state.load_start is not None or self.rank_packs.pending(req_id)

    def take_merges(self) -> list[MergeJob]:
        """H2O merges to run before this step's forward pass (:meth:`forget` drops those of
        requests whose blocks vLLM took back in the meantime)."""
        merges, self.merges = self.merges, []
        return merges

    def take_forgotten(self) -> set[str]:
        """Requests whose blocks vLLM took back since the last call (the worker drops their
        per-head counts before the next forward pass)."""
        taken, self.forgotten = self.forgotten, set()
        return taken

    def _release(self, req_id: str) -> None:
        hole = self.planner.visible(req_id, self.step)
        if hole is None:
            return  # no hole yet
        state = self._state(req_id)
        if self._held_back(state, req_id):
            return  # blocks the worker may still read or write
        ledger = self._ledger()
        row = ledger.blocks(req_id)
        if not row or row[0].block_id != hole.first_block:
            raise RuntimeError(
                f"request {req_id!r}: block 0 is {row[0].block_id if row else None}, its hole "
                f"was planned on block {hole.first_block}; a preemption was not seen"
            )
        lo = hole.start if state.released_to is None else max(hole.start, state.released_to)
        hi = min(hole.stop, len(row))
        if lo >= hi:
            return
        released = ledger.release(req_id, lo, hi)
        state.released_to = hi
        state.freed += len(released.freed)
        self.stats.blocks_released += len(released.freed)
        self.stats.blocks_kept_shared += len(released.kept)

    # ------------------------------------------------------------------ per step
    def plan_step(self, scheduler_output: Any, meta: StepMetadata) -> list[PackJob]:
        """Open prefill-end holes, give visible hole blocks back, add captures to ``meta``;
        return the packs to run.

        Called from ``build_connector_meta``, after the store half filled ``meta`` and
        before it adds the step's holes (:meth:`SchedulerHalf.end_step`).
        """
        ledger = self._ledger()
        packs: list[PackJob] = []
        step = self.step
        self.scored = {}
        self.stats.preemptions += len(shim.preempted_req_ids(scheduler_output))
        load_starts = {load.req_id: load.start for load in meta.loads}
        for sched in shim.scheduled_requests(scheduler_output):
            state = self.states.get(sched.req_id)
            request = None if state is None else state.request
            blocks = ledger.blocks(sched.req_id)
            if state is None or request is None or not blocks:
                continue
            if sched.replace:  # new or resumed: what vLLM's own cache served it
                hit = load_starts.get(sched.req_id, sched.num_computed)
                state.hit_blocks = hit // self.block_size
                if sched.req_id in load_starts and state.hole is not None:
                    self.stats.holes_adopted += 1  # a compacted load's hole: released here
            first = int(blocks[0].block_id)
            prompt_len = int(request.num_prompt_tokens)
            lo, hi = sched.num_computed, sched.num_computed + sched.num_scheduled
            if lo >= prompt_len and self._h2o_owned(sched.req_id):
                self.scored[first] = sched.req_id  # H2O: accumulate its decode attention
            if self.capture:
                self._plan_capture(sched.req_id, blocks, prompt_len, lo, hi, meta)
            if lo < prompt_len <= hi:
                protected = self._protected_blocks(sched.req_id, blocks, prompt_len)
                pack = self.planner.prefill_end(sched.req_id, prompt_len, first, step, protected)
                if self.guard is not None and sched.req_id in self.planner.holes:
                    # packed blocks are rewritten; blocks mode rewrites none, but every
                    # token after the prompt attends past its hole
                    frontier = prompt_len // self.block_size if pack is None else protected
                    self.guard.freeze(sched.req_id, frontier)
                if pack is not None:
                    self.stats.protected_blocks += protected
                    row = [block.block_id for block in blocks]
                    packs.append(
                        PackJob(
                            sched.req_id,
                            row,
                            pack.num_tokens,
                            pack.kept,
                            pack.reserved,
                            pack.start,
                        )
                    )
                    self.stats.packs += 1
                    if state.packed:
                        self.stats.repacks += 1  # recomputed after a preemption
                    state.packed = True
        for req_id, state in self.states.items():
            if state.hole is None or state.request is None:
                continue
            self._release(req_id)
            held = len(ledger.blocks(req_id)) - state.freed
            if held > self.stats.peak_held.get(req_id, 0):
                self.stats.peak_held[req_id] = held
        for job in packs:  # its hole goes back once every rank reported the pack
            self.rank_packs.expect(job.req_id)
        return packs

    def _protected_blocks(self, req_id: str, row: list[Any], prompt_len: int) -> int:
        """Leading prompt blocks a pack must leave alone (0 without prefix caching): those
        vLLM's cache served this request (other requests may hit them again) and, up to
        the last one, those another request holds too (it reads them through a hit)."""
        if self.guard is None:
            return 0
        full = prompt_len // self.block_size
        protected = min(self._state(req_id).hit_blocks, full)
        for index in range(full - 1, protected - 1, -1):
            if row[index].ref_cnt > 1:
                return index + 1
        return protected

    def _plan_capture(
        self, req_id: str, row: list[Any], prompt_len: int, lo: int, hi: int, meta: StepMetadata
    ) -> None:
        bs = self.block_size
        window_lo = max(prompt_len - self.window, lo)
        window_hi = min(hi, prompt_len)
        if window_lo >= window_hi:
            return
        positions = list(range(window_lo, window_hi))
        slots = [int(row[p // bs].block_id) * bs + p % bs for p in positions]
        meta.captures.append(CaptureSpec(req_id, slots, positions))


def needs_scores(policy: Any) -> bool:
    return bool(policy.needs & SCORE_NEEDS)
