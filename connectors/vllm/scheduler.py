"""The connector's scheduler side: store lookups, loads, saves, holes and released blocks.

Cheap and free of store I/O on the engine's scheduling loop: it asks which chunks exist (an
index lookup, cached per request, never a payload fetch) and describes each step's work in
one :class:`~connectors.vllm.metadata.LMCompactMetadata` that names chunks by key and blocks
by id. The worker fetches and verifies chunks; a chunk that turns out missing or bad there is
reported back and the request is recomputed (vLLM's ``kv_load_failure_policy``
"recompute"), never loaded wrong.

Everything it knows about a request lives in that request's one
:class:`~connectors.vllm.requests.RequestState` (``self.states``); the only other state is
the store's index as the workers reported it (by chunk key) and the envelope of the next
step (requests whose blocks vLLM took back, H2O merges), which goes out with that step.

Packed load of ``n`` chunks of ``C`` tokens keeping ``K`` each, starting at token ``s``::

    logical tokens  s ........................ s+n*C | computed by vLLM ->
    slots           [ kept c0 | kept c1 | .. ][ hole: (C-K)*n tokens ][ tail .. ]
                    s          s+K         s+n*K                    s+n*C

Sliding-window layers also skip slots ``[0, s+(n-1)*K)`` (the hole's ``window_lead``): only
the last chunk's kept rows (its last K tokens) sit at their logical distance from the tail.

What exists in the store is the union of two views: the store's own index (shared with the
worker when both run in one process; Redis is shared across processes) and the keys the
workers report as stored (the only view of a worker's private CPU tier under vLLM's
multiprocess engine). A request whose next chunk is still being saved waits (``None`` to
vLLM: "ask again") until the save is reported or ``save_wait_s`` passes. Under tensor
parallelism every rank stores its slice of a chunk under its own key; a chunk exists only
when every rank's slice does.

Release group (``"release"``), timeline of one compacted prompt (step = one ``schedule()`` +
forward)::

    step t     schedule: prompt completes -> PackJob(req) in metadata, hole planned
               worker:   forward (full prompt) -> pack kept tokens into blocks [0, kb)
    step t+1   schedule: hole visible -> its blocks go back to the pool (null in the row)
               worker:   attention skips the hole (virtual block table)

A block released in schedule ``t+1`` can be handed to another request in that schedule and
written by forward ``t+1``, which runs after forward ``t``, so the pack in ``t`` has read it
before anyone writes it. Hole blocks are given back in vLLM's ``allocate_slots`` (through
:func:`connectors.vllm.patches.kv_cache_manager.hook_allocation`), before vLLM sizes the
request's new blocks, so they already count for this step's admissions.

Admission without thrash (``reserve_growth``): a request that holds no block yet is refused
(vLLM keeps it waiting) unless::

    free_blocks - peak(new) >= sum over running r of max(0, peak(r) - own blocks(r))

with ``peak`` the most blocks a request can ever hold (:mod:`lmcompact.compaction.admission`):
its prompt, or its growth up to ``max_tokens`` minus its prompt's hole, or with a decode budget
of B blocks at most ``max(B, kept blocks) + 1`` (+1 with tokens in flight). When no request is
running, nothing is refused.

H2O decode: a block that joins the hole in schedule ``t`` is released there too, but its
tokens are still needed; its :class:`~lmcompact.compaction.heavy_hitters.MergeJob` (with the
block's physical id, taken before the release) goes into step ``t``'s metadata and the worker
merges it before step ``t``'s loads and forward pass, the first things that may write it.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from connectors.vllm import step_trace
from connectors.vllm.config import load_width
from connectors.vllm.disaggregation import (
    KV_CONSUMER,
    KV_PRODUCER,
    stored_params,
    stored_prefix,
)
from connectors.vllm.metadata import (
    CaptureSpec,
    LMCompactMetadata,
    LoadSpec,
    PackJob,
    ReconstructCapture,
    SaveSpec,
    StepMetadata,
    SurprisalSpec,
    WorkerReport,
)
from connectors.vllm.patches import kv_cache_manager as manager_patch
from connectors.vllm.patches import scheduler_output as output_patch
from connectors.vllm.reconstruct import (
    ReconstructRequest,
    reconstruct_request,
    save_allowed,
    token_scores,
)
from connectors.vllm.requests import HoleState, RequestState, RequestStates
from connectors.vllm.spec import ConnectorSpec
from lmcompact.compaction import admission
from lmcompact.compaction.admission import RequestShape
from lmcompact.compaction.heavy_hitters import MergeJob
from lmcompact.compaction.hole_planner import HolePlanner
from lmcompact.compaction.holes import keyed_by_last_block
from lmcompact.compaction.save_job import SCORE_NEEDS
from lmcompact.policies import Need
from lmcompact.store import ChunkKey, ChunkKeyer, TieredStore

logger = logging.getLogger(__name__)

__all__ = ["ReleaseStats", "Scheduler"]

REMOTE_POLL_S = 0.005
"""How often a consumer request waiting for a producer's chunks asks the store again."""


@dataclass
class ReleaseStats:
    """Counters of the release path (read by tests and the capacity benchmark)."""

    packs: int = 0
    blocks_released: int = 0
    blocks_kept_shared: int = 0
    holes_adopted: int = 0  # compacted store loads whose holes this group gives back
    repacked_loads: int = 0  # two-stage loads packed again to the final budget
    repacks: int = 0
    preemptions: int = 0
    admissions_deferred: int = 0
    protected_blocks: int = 0  # prompt blocks packs left untouched (prefix caching)
    peak_held: dict[str, int] = field(default_factory=dict)


class Scheduler:
    """Decides loads, saves, holes and releases for every request of one engine.

    Args:
        spec: the connector's spec.
        rank_stores: one store per tensor-parallel rank (rank 0's first): their indexes say
            which chunk slices exist.
        save_wait_s: how long a request waits for a chunk another request is saving.
    """

    def __init__(
        self, spec: ConnectorSpec, rank_stores: Sequence[TieredStore], save_wait_s: float = 30.0
    ) -> None:
        config, facts = spec.config, spec.facts
        if len(rank_stores) != facts.tp_size:
            raise ValueError(
                f"one store per tensor-parallel rank: got {len(rank_stores)} for "
                f"{facts.tp_size} ranks"
            )
        self.spec = spec
        self.config = config
        self.block_size = facts.block_size
        self.tp_size = facts.tp_size
        self.rank_stores = list(rank_stores)
        self.store = self.rank_stores[0]
        self.keyer = ChunkKeyer(spec.namespaces[0], config.store.chunk_size)
        self.slots = spec.slots
        window = facts.sliding_window
        self.recompute_window = window if window and spec.slots < config.store.chunk_size else 0
        self.save_wait_s = save_wait_s
        self.policy = spec.store_policy  # what the saved chunks' compaction reads
        self.states = RequestStates()  # the one record per live request
        self._scheduled: list[str] = []  # requests scheduled in the step being planned
        self._step_rows = [0, 0, 0]  # the step's prefill tokens, prefill rows, decode rows
        self.trace = None if config.step_trace is None else step_trace.StepTrace(config.step_trace)
        self._reported: set[ChunkKey] = set()  # slice keys stored, as the workers said
        self._saving: dict[ChunkKey, float] = {}  # slice save planned -> time planned
        self._version = 0  # bumps whenever what is known to exist changes
        self._next = LMCompactMetadata(StepMetadata())  # what the next step's metadata carries
        self.stats = {
            "lookups": 0,
            "hits": 0,  # lookups that found the prefix's first chunk, or found none
            "misses": 0,
            "store_queries": 0,
            "hit_chunks": 0,
            "waits": 0,
            "wait_timeouts": 0,
            "load_failures": 0,
            "remote_waits": 0,  # kv_consumer: requests that waited for a producer's chunks
            "remote_wait_timeouts": 0,
        }
        self.namespace_hex = spec.namespaces[0].digest().hex()
        # release group
        self.planner: HolePlanner | None = None
        if config.release is not None:
            self.planner = spec.planner(self.states.holes)
        needs_scores = bool(spec.policy.needs & SCORE_NEEDS)
        # the save path captures the same window when it is on
        self.capture = needs_scores and config.window > 0 and not config.store.save
        self.reserve_growth = config.release is not None and config.release.reserve_growth
        self.release_stats = ReleaseStats()
        self.ledger: manager_patch.BlockLedger | None = None
        self.guard: manager_patch.PrefixCacheGuard | None = None  # with vLLM's prefix caching
        manager_patch.track_kv_cache_managers()  # vLLM 0.26 binds only the manager's pool

    @property
    def step(self) -> int:
        """The step being planned."""
        return self.states.step

    # ------------------------------------------------------------------ binding
    def bind_manager(self, kv_cache_manager: Any) -> None:
        """vLLM's ``KVCacheManager``: guard its prefix cache, hook its allocation (release)."""
        if self.guard is None and self.spec.facts.prefix_caching:
            self.guard = manager_patch.PrefixCacheGuard(kv_cache_manager, self.states)
        if self.planner is not None and self.ledger is None:
            self.ledger = manager_patch.BlockLedger(kv_cache_manager)
            manager_patch.hook_allocation(
                kv_cache_manager, self.admits, self.before_allocate, self.forget
            )

    def bind_pool(self, block_pool: Any) -> None:
        """vLLM 0.26 hands over only the block pool; its owner is the scheduler's manager."""
        wants_guard = self.guard is None and self.spec.facts.prefix_caching
        wants_ledger = self.planner is not None and self.ledger is None
        if not (wants_guard or wants_ledger):
            return
        manager = manager_patch.kv_cache_manager_owning(block_pool)
        if manager is None:
            raise RuntimeError(
                "LMCompactConnector could not find the KVCacheManager that owns the block "
                "pool, so it can neither keep compacted blocks out of vLLM's prefix cache nor "
                "give blocks back; start vLLM with enable_prefix_caching=False and without the "
                '"release" group'
            )
        self.bind_manager(manager)

    def _ledger(self) -> manager_patch.BlockLedger:
        if self.ledger is None:
            # without the manager no block can be released: refuse instead of saving nothing
            raise RuntimeError(
                "the release group was never bound to vLLM's KVCacheManager (neither "
                "bind_kv_cache_manager nor bind_gpu_block_pool was called)"
            )
        return self.ledger

    # ------------------------------------------------------------------ requests
    def _track(self, request: Any) -> RequestState:
        req_id = request.request_id
        tracked = self.states.get(req_id)
        if tracked is None:
            prompt = output_patch.request_prompt_ids(request)
            tracked = RequestState(prompt=prompt, keys=self.keyer.keys(prompt))
            tracked.reconstruct = self._reconstruct_len(request, prompt)
            self._given_scores(request, tracked)
            if self.spec.kv_role == KV_CONSUMER:
                self._producer_said(request, tracked)
            self.states.add(req_id, tracked)
        return tracked

    def finished(self, req_id: str) -> dict[str, Any] | None:
        """The request is done; a producer returns what it stored for the consumer."""
        tracked = self.states.get(req_id)
        params = None
        if self.spec.kv_role == KV_PRODUCER and tracked is not None and tracked.stored_chunks:
            stored = tracked.stored_chunks * self.config.store.chunk_size
            params = stored_params(stored, self.namespace_hex)
        self.states.forget(req_id, finished=True)
        return params

    def forget(self, req_id: str) -> None:
        """vLLM takes every block of ``req_id`` back (finish, abort, preemption)."""
        self.states.forget(req_id, finished=False)
        self._next.merges = [job for job in self._next.merges if job.req_id != req_id]
        self._next.forgotten.add(req_id)

    # ------------------------------------------------------------------ lookups
    def num_new_matched_tokens(self, request: Any, num_computed: int) -> int | None:
        """Tokens beyond ``num_computed`` that stored chunks cover (0 when none), or None
        while the next chunk's save is in flight (vLLM asks again on a later step)."""
        tracked = self._track(request)
        tracked.pending, tracked.confirmed = 0, False
        c = self.config.store.chunk_size
        if (
            not self.config.store.load
            or num_computed % c
            or tracked.reconstruct is not None
            or tracked.no_save
            or (num_computed and self.config.store.per_head is not None)
        ):
            # a reconstruction or scoring pass computes its whole prompt itself; per-head
            # loads pack each head's rows from slot 0 (after vLLM's own hits they could not)
            return 0
        first = num_computed // c
        last = self.loadable_chunks(len(tracked.prompt))
        if last <= first:
            return 0
        now = time.monotonic()
        if tracked.remote_since is not None and now - tracked.remote_checked < REMOTE_POLL_S:
            return None  # waiting for a producer's chunks; ask the store again shortly
        self.stats["lookups"] += 1
        present = self._present(tracked, first, last)
        if present < last and self._save_in_flight(tracked.keys[present]):
            self.stats["waits"] += 1
            return None
        if self._awaits_producer(request.request_id, tracked, present, last, now):
            return None
        if present <= first:
            self.stats["misses"] += 1
            return 0
        self.stats["hits"] += 1
        tracked.pending, tracked.pending_start = present - first, num_computed
        return tracked.pending * c

    def loadable_chunks(self, prompt_len: int) -> int:
        """Leading chunks a prompt of ``prompt_len`` tokens may load: every whole chunk
        but the one with its last token (vLLM computes >= 1 token) and, where compacted
        loads meet sliding-window layers, every chunk inside its last window: a compacted
        load shows those layers only its last chunk's kept rows (:mod:`lmcompact.compaction
        .holes`), so the window before the prompt's end is computed in full, the questions
        at its end see a whole window and an in-place pack keeps exact windows."""
        c = self.config.store.chunk_size
        last = (prompt_len - 1) // c
        if self.recompute_window:
            last = min(last, max(0, prompt_len - self.recompute_window) // c)
        return last

    def after_alloc(self, request: Any, num_external_tokens: int) -> None:
        """vLLM allocated blocks for the matched tokens (or none)."""
        tracked = self._track(request)
        tracked.confirmed = num_external_tokens > 0 and tracked.pending > 0
        if not tracked.confirmed:
            tracked.pending = 0
            return
        if self.guard is not None and self.slots < self.config.store.chunk_size:
            # vLLM hashed the load's blocks in allocate_slots; they will hold kept rows, and
            # the rest of the request attends to them: unhash before any other lookup
            self.guard.freeze(request.request_id, tracked.pending_start // self.block_size)

    def _present(self, tracked: RequestState, first: int, last: int) -> int:
        """Leading chunks of ``keys[:last]`` known to exist (from ``first`` on); cached per
        request until the known set changes, so a waiting request costs no store query."""
        probe = (first, last, self._version)
        if tracked.looked_up == probe:
            return tracked.present
        present = first
        while present < last and self._reported.issuperset(self._slices(tracked.keys[present])):
            present += 1
        if present < last:
            self.stats["store_queries"] += 1
            try:
                present += self._lookup(tracked.keys[present:last])
            except Exception:  # the store answers misses for faults; this is a last guard
                logger.exception("store lookup failed; treating the rest as a miss")
        tracked.looked_up, tracked.present = probe, present
        return present

    def _producer_said(self, request: Any, tracked: RequestState) -> None:
        """Read the producer's entry of a consumer request's ``kv_transfer_params``."""
        try:
            remote = stored_prefix(getattr(request, "kv_transfer_params", None))
        except ValueError as error:
            logger.error("request %s: %s; served without waiting", request.request_id, error)
            return
        if remote is not None and remote.namespace != self.namespace_hex:
            logger.error(
                "request %s: its producer stored the prefix under store namespace %s, this "
                "consumer reads %s (another model, policy, budget or store format): it cannot "
                "load those chunks; give both instances the same kv_connector_extra_config",
                request.request_id,
                remote.namespace,
                self.namespace_hex,
            )
            return
        tracked.remote = remote

    def _awaits_producer(
        self, req_id: str, tracked: RequestState, present: int, last: int, now: float
    ) -> bool:
        """Whether a consumer request waits for chunks its producer stored that the store
        does not hold yet (the producer answered before its background save landed)."""
        if tracked.remote is None:
            return False
        expected = min(tracked.remote.tokens // self.config.store.chunk_size, last)
        if present >= expected:
            tracked.remote_since = None
            return False
        if tracked.remote_since is None:
            tracked.remote_since = now
            self.stats["remote_waits"] += 1
        if now - tracked.remote_since <= self.config.store.remote_wait_s:
            tracked.remote_checked = now
            tracked.looked_up = None  # ask the store again, not the cached answer
            return True
        self.stats["remote_wait_timeouts"] += 1
        logger.warning(
            "request %s: its producer stored %d chunks, %d reached the store within "
            "store.remote_wait_s=%.1f s; loading those and recomputing the rest",
            req_id,
            expected,
            present,
            self.config.store.remote_wait_s,
        )
        tracked.remote, tracked.remote_since = None, None
        return False

    def _slices(self, key: ChunkKey) -> tuple[ChunkKey, ...]:
        """Store keys of every rank's slice of the chunk ``key`` (``(key,)`` with one rank)."""
        return key.slices(self.tp_size)

    def _lookup(self, keys: list[ChunkKey]) -> int:
        """Leading chunks of ``keys`` whose every slice the store's index holds."""
        present = len(keys)
        for rank in range(self.tp_size):
            if present == 0:
                break
            ranked = [key.for_rank(rank, self.tp_size) for key in keys[:present]]
            present = min(present, self.rank_stores[rank].lookup_prefix(ranked))
        return present

    def _save_in_flight(self, key: ChunkKey) -> bool:
        """Whether some rank's slice of chunk ``key`` is still being saved."""
        waiting = [s for s in self._slices(key) if s in self._saving]
        if not waiting:
            return False
        planned = min(self._saving[s] for s in waiting)
        if time.monotonic() - planned <= self.save_wait_s:
            return True
        for s in waiting:
            del self._saving[s]
        self.stats["wait_timeouts"] += 1
        logger.warning(
            "a chunk save planned %.0f s ago was never reported; serving without it "
            "(the tokens are recomputed)",
            self.save_wait_s,
        )
        return False

    # ------------------------------------------------------------------ worker reports
    def take_report(self, report: WorkerReport) -> set[str]:
        """Fold a worker report in; return the requests whose loads failed (their holes
        are gone: vLLM recomputes them from the load's start)."""
        if report.saved or report.missing:
            self._version += 1
        self._reported |= report.saved
        self._reported -= report.missing
        for key in report.saved | report.save_failed:
            self._saving.pop(key, None)
        if report.save_failed:
            self._version += 1
        for req_id in report.loaded - report.load_failed:  # one refusing rank fails a load
            tracked = self.states.get(req_id)
            if tracked is not None:
                tracked.load_start = None
        for req_id, rank in report.packed:  # a pack's hole goes back once every rank packed
            tracked = self.states.get(req_id)
            if tracked is not None:
                tracked.packs_owed.discard(rank)
        failed: set[str] = set()
        for req_id in report.load_failed:
            self.stats["load_failures"] += 1
            tracked = self.states.get(req_id)
            if tracked is None:
                continue
            failed.add(req_id)
            if tracked.load_start is not None:
                tracked.loaded_end = tracked.load_start
            tracked.drop_hole()
            tracked.load_start = None
            tracked.saved = False  # the recompute stores what was missing
        return failed

    # ------------------------------------------------------------------ request options
    def _given_scores(self, request: Any, tracked: RequestState) -> None:
        """Read a request's ``save`` flag and ``token_scores`` (``reconstruct.py``)."""
        params = getattr(request, "kv_transfer_params", None)
        try:
            tracked.no_save = not save_allowed(params)
            scores = token_scores(params, len(tracked.prompt))
        except ValueError as error:
            logger.error("request %s: %s; served as a plain request", request.request_id, error)
            return
        if scores is not None and Need.CONTEXT_SCORES not in self.policy.needs:
            logger.error(
                "request %s gives token_scores, but policy %r does not read context scores; "
                "ignored",
                request.request_id,
                self.config.store_policy_name,
            )
            return
        tracked.token_scores = scores

    def _reconstruct_len(self, request: Any, prompt: list[int]) -> ReconstructRequest | None:
        """The parts of ``request`` when it is a valid reconstruction pass the policy can use."""
        try:
            t = reconstruct_request(getattr(request, "kv_transfer_params", None), prompt)
        except ValueError as error:
            logger.error("request %s: %s; served as a plain request", request.request_id, error)
            return None
        if t is None:
            return None
        if not self.config.store.save or Need.CONTEXT_SCORES not in self.policy.needs:
            logger.error(
                "request %s asks for a reconstruction pass, but policy %r (save=%s) does not "
                "store chunks scored by one; served as a plain request, nothing stored",
                request.request_id,
                self.config.store_policy_name,
                self.config.store.save,
            )
            return None
        logger.info(
            "request %s is a reconstruction pass: stores its first %d tokens, scored by the "
            "queries from position %d",
            request.request_id,
            t.context_len,
            t.copy_start,
        )
        return t

    # ------------------------------------------------------------------ step planning
    def build_connector_meta(self, scheduler_output: Any) -> LMCompactMetadata:
        """This step's loads, captures, saves, packs and holes, in one envelope."""
        envelope, self._next = self._next, LMCompactMetadata(StepMetadata())
        meta = envelope.step
        self._plan_store(scheduler_output, meta)
        if self.planner is not None:
            envelope.packs = self._plan_release(scheduler_output, meta, envelope)
        self._add_holes(meta)
        if self.trace is not None:
            self._trace_step(meta, envelope)
        if self.planner is not None and (envelope.packs or envelope.merges or not meta.is_idle()):
            # holes, captures and loads must be in place before the forward pass
            output_patch.force_sync_loads(scheduler_output)
        return envelope

    def _plan_store(self, scheduler_output: Any, meta: StepMetadata) -> None:
        """Loads, captures and saves of the step (its holes: :meth:`_add_holes`)."""
        self._scheduled = []
        self._step_rows = [0, 0, 0]  # prefill tokens, prefill rows, decode rows
        for sched in output_patch.scheduled_requests(scheduler_output):
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
            tracked.seq_len = sched.num_computed + sched.num_scheduled
            self._scheduled.append(sched.req_id)
            if tracked.seq_len <= len(tracked.prompt):  # some of its prompt this step
                self._step_rows[0] += sched.num_scheduled
                self._step_rows[1] += 1
            elif sched.num_scheduled:
                self._step_rows[2] += 1
            if sched.replace:
                tracked.block_ids = list(sched.new_block_ids)
                self._start(sched, tracked, meta)
            else:
                tracked.block_ids.extend(sched.new_block_ids)
            self._plan_save(sched, tracked, meta)
        for req_id in output_patch.preempted_req_ids(scheduler_output):
            self.states.forget(req_id, finished=False)
            meta.taken_back.add(req_id)
        meta.finished = output_patch.finished_req_ids(scheduler_output)
        for req_id in meta.finished:
            self.states.forget(req_id, finished=True)

    def _trace_step(self, meta: StepMetadata, envelope: LMCompactMetadata) -> None:
        """One ``step_trace`` line for the step being planned (its number goes to the
        workers with the metadata, so their pack lines name it)."""
        assert self.trace is not None
        meta.index = self.states.step - 1  # _add_holes counted it
        prefill_tokens, prefill_rows, decode_rows = self._step_rows
        self.trace.write(
            step_trace.step_record(
                meta.index,
                prefill_tokens,
                prefill_rows,
                decode_rows,
                loads=len(meta.loads),
                load_tokens=sum(len(load.keys) for load in meta.loads)
                * self.config.store.chunk_size,
                packs=len(envelope.packs),
                saves=len(meta.saves),
            )
        )

    def _add_holes(self, meta: StepMetadata) -> None:
        """Add the visible hole of every request scheduled this step to ``meta`` (whoever
        opened it: a compacted load, or the release group) and count the step.

        With vLLM's prefix caching, a hole of a request whose block 0 may be shared
        (frontier not 0) is keyed by the row's last block instead.
        """
        step = self.states.step
        for req_id in self._scheduled:
            tracked = self.states.get(req_id)
            hole = None if tracked is None else tracked.hole
            if tracked is None or tracked.seq_len is None:
                continue
            seq_len, tracked.seq_len = tracked.seq_len, None
            if hole is not None and hole.visible_from > step and tracked.previous_hole:
                hole = tracked.previous_hole  # two-stage load: its pack's hole comes next step
            elif hole is not None and hole.visible_from <= step:
                tracked.previous_hole = None
            if hole is None or hole.length == 0 or hole.visible_from > step:
                continue
            wire = hole.wire(req_id)
            if self.guard is not None and tracked.frontier != 0:
                wire = keyed_by_last_block(wire, tracked.block_ids, seq_len, self.block_size)
            meta.holes[wire.first_block] = wire
        self._scheduled = []
        self.states.step += 1

    def _start(
        self, sched: output_patch.ScheduledRequest, tracked: RequestState, meta: StepMetadata
    ) -> None:
        """A request got (new) blocks: emit its load, if confirmed, and open its hole."""
        c, bs = self.config.store.chunk_size, self.block_size
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
        width = load_width(count, self.slots, bs)
        hole_tokens = count * c - width
        logger.info(
            "loading %s from the store: %d prefix tokens as %d %s per (layer, head)%s",
            sched.req_id,
            count * c,
            width,
            "slots (per-head counts, dense cells)" if self.config.store.per_head else "kept",
            " (compacted)" if hole_tokens else "",
        )
        if hole_tokens:
            # the release group gives its blocks back once the worker confirmed the load
            tracked.hole = HoleState(
                first_block=tracked.block_ids[0],
                start=(start + width) // bs,
                length=hole_tokens // bs,
                visible_from=self.states.step,
                owned=False,
                window_lead=(start + (count - 1) * self.slots) // bs,
            )

    def capture_positions(self, prompt_len: int) -> list[int]:
        """Sorted prompt positions whose queries the worker copies for the save: the last
        ``window`` (observation window) and the policy's ``context_queries`` (KVzip's
        sample across the prompt)."""
        wanted = set(range(max(0, prompt_len - self.config.window), prompt_len))
        sampled = self.policy.context_queries(prompt_len)
        if sampled is not None:
            wanted.update(int(p) for p in sampled.tolist())
        return sorted(wanted)

    def _plan_save(
        self, sched: output_patch.ScheduledRequest, tracked: RequestState, meta: StepMetadata
    ) -> None:
        """Query captures in the steps that compute the wanted prompt positions; the save in
        the step that completes the prompt."""
        if not self.config.store.save or tracked.saved or tracked.no_save:
            return
        c, bs = self.config.store.chunk_size, self.block_size
        prompt_len = len(tracked.prompt)
        lo, hi = sched.num_computed, min(sched.num_computed + sched.num_scheduled, prompt_len)
        recon = tracked.reconstruct
        if tracked.capture is None:
            tracked.capture = (
                self.capture_positions(prompt_len)
                if recon is None
                else list(range(recon.copy_start, prompt_len))  # the repeated copy
            )
        first, last = (
            bisect.bisect_left(tracked.capture, lo),
            bisect.bisect_left(tracked.capture, hi),
        )
        if self._engine_scores(tracked):
            self._plan_surprisal(sched.req_id, tracked, lo, hi, meta)
        if first < last:
            positions = tracked.capture[first:last]
            slots = [tracked.block_ids[p // bs] * bs + p % bs for p in positions]
            scored = (
                None
                if recon is None
                else ReconstructCapture(list(tracked.block_ids), recon.context_len)
            )
            meta.captures.append(CaptureSpec(sched.req_id, slots, positions, scored))
        if hi < prompt_len:
            return
        tracked.saved = True
        # never the second copy
        n_full = prompt_len // c if recon is None else recon.context_len // c
        first = tracked.loaded_end // c
        if first < n_full:
            first = max(first, self._present(tracked, 0, n_full))
        while first < n_full and self._save_in_flight(tracked.keys[first]):
            first += 1  # another request is saving the same leading chunks right now
        tracked.stored_chunks = first
        if first >= n_full:
            return
        if (
            recon is None
            and tracked.token_scores is None
            and self.policy.scores_given
            and self.config.store.token_scores == "client"
        ):
            logger.warning(
                "request %s: policy %r scores with token_scores given with the storing "
                "request (connectors.vllm.reconstruct.store_surprisal_context); this one has "
                "none, its %d new chunks are not stored",
                sched.req_id,
                self.config.store_policy_name,
                n_full - first,
            )
            return
        keys = tracked.keys[first:n_full]
        tracked.stored_chunks = n_full
        now = time.monotonic()
        self._saving.update((s, now) for key in keys for s in self._slices(key))
        meta.saves.append(
            SaveSpec(
                req_id=sched.req_id,
                block_ids=list(tracked.block_ids),
                keys=keys,
                start=first * c,
                num_tokens=(prompt_len if recon is None else recon.context_len) - first * c,
                reconstruct=recon is not None,
                token_scores=(
                    None if tracked.token_scores is None else tracked.token_scores[first * c :]
                ),
            )
        )

    def _engine_scores(self, tracked: RequestState) -> bool:
        """Whether the worker scores this request's prompt itself (in-engine surprisal)."""
        return (
            self.policy.scores_given
            and tracked.reconstruct is None
            and tracked.token_scores is None
            and self.config.store.token_scores == "engine"
        )

    def _plan_surprisal(
        self, req_id: str, tracked: RequestState, lo: int, hi: int, meta: StepMetadata
    ) -> None:
        """Score the prompt tokens this step computes: the hidden state at ``p`` predicts
        token ``p + 1`` (the last prompt position predicts none)."""
        prompt, bs = tracked.prompt, self.block_size
        positions = list(range(lo, min(hi, len(prompt) - 1)))
        if not positions:
            return
        slots = [tracked.block_ids[p // bs] * bs + p % bs for p in positions]
        next_ids = [prompt[p + 1] for p in positions]
        meta.surprisal.append(SurprisalSpec(req_id, slots, positions, next_ids, len(prompt)))

    # ------------------------------------------------------------------ release group
    def _plan_release(
        self, scheduler_output: Any, meta: StepMetadata, envelope: LMCompactMetadata
    ) -> list[PackJob]:
        """Open prefill-end holes, give visible hole blocks back, add captures to ``meta``;
        return the packs to run (after the store path filled ``meta``, before its holes)."""
        planner = self._planner()
        ledger = self._ledger()
        packs: list[PackJob] = []
        step = self.step
        stats = self.release_stats
        stats.preemptions += len(output_patch.preempted_req_ids(scheduler_output))
        load_starts = {load.req_id: load.start for load in meta.loads}
        for sched in output_patch.scheduled_requests(scheduler_output):
            state = self.states.get(sched.req_id)
            request = None if state is None else state.request
            blocks = ledger.blocks(sched.req_id)
            if state is None or request is None or not blocks:
                continue
            if sched.replace:  # new or resumed: what vLLM's own cache served it
                hit = load_starts.get(sched.req_id, sched.num_computed)
                state.hit_blocks = hit // self.block_size
                if sched.req_id in load_starts and state.hole is not None:
                    stats.holes_adopted += 1  # a compacted load's hole: released here
            first = int(blocks[0].block_id)
            prompt_len = int(request.num_prompt_tokens)
            lo, hi = sched.num_computed, sched.num_computed + sched.num_scheduled
            if lo >= prompt_len and self._h2o_owned(sched.req_id):
                envelope.scored[first] = sched.req_id  # H2O: accumulate its decode attention
            if self.capture:
                self._plan_capture(sched.req_id, blocks, prompt_len, lo, hi, meta)
            if not lo < prompt_len <= hi:
                continue
            if self.config.two_stage and state.hole is not None and not state.hole.owned:
                self._plan_repack(sched.req_id, state, blocks, prompt_len, packs)
                continue
            protected = self._protected_blocks(state, blocks, prompt_len)
            pack = planner.prefill_end(sched.req_id, prompt_len, first, step, protected)
            if self.guard is not None and sched.req_id in planner.holes:
                # packed blocks are rewritten; blocks mode rewrites none, but every
                # token after the prompt attends past its hole
                frontier = prompt_len // self.block_size if pack is None else protected
                self.guard.freeze(sched.req_id, frontier)
            if pack is None:
                continue
            stats.protected_blocks += protected
            row = [block.block_id for block in blocks]
            packs.append(
                PackJob(sched.req_id, row, pack.num_tokens, pack.kept, pack.reserved, pack.start)
            )
            stats.packs += 1
            if state.packed:
                stats.repacks += 1  # recomputed after a preemption
            state.packed = True
            if self.tp_size > 1:  # (again, after a preemption: all ranks owe it)
                state.packs_owed = set(range(self.tp_size))
        for req_id, state in self.states.items():
            if state.hole is None or state.request is None:
                continue
            self._release(req_id)
            held = len(ledger.blocks(req_id)) - state.freed
            if held > stats.peak_held.get(req_id, 0):
                stats.peak_held[req_id] = held
        return packs

    def _plan_repack(
        self,
        req_id: str,
        state: RequestState,
        blocks: list[Any],
        prompt_len: int,
        packs: list[PackJob],
    ) -> None:
        """Two-stage loads: pack the loaded selection and the tail to the final budget at
        the prefill end (:meth:`~lmcompact.compaction.hole_planner.HolePlanner.repack`)."""
        if self._protected_blocks(state, blocks, prompt_len):
            return  # vLLM's own cache served leading blocks: the stored selection stays
        planned = self._planner().repack(req_id, prompt_len, self.step)
        if planned is None:
            return
        pack, old = planned
        state.previous_hole = old  # attention skips it until the new hole is visible
        if state.released_to is not None and state.released_to > old.start:
            state.released_before = (old.start, state.released_to)
        state.released_to = None
        if self.guard is not None:
            self.guard.freeze(req_id, 0)  # kept blocks are rewritten from block 0
        row = [block.block_id for block in blocks]
        outside = row[: old.start] + row[old.stop : prompt_len // self.block_size]
        packs.append(
            PackJob(
                req_id,
                outside,
                pack.num_tokens,
                pack.kept,
                pack.reserved,
                hole_tokens=old.length * self.block_size,
            )
        )
        self.release_stats.packs += 1
        self.release_stats.repacked_loads += 1
        state.packed = True
        if self.tp_size > 1:
            state.packs_owed = set(range(self.tp_size))

    def _planner(self) -> HolePlanner:
        if self.planner is None:
            raise RuntimeError('release-group call without the "release" group')
        return self.planner

    def before_allocate(self, request: Any) -> None:
        """A request is about to get blocks this step: release and grow its hole."""
        planner = self._planner()
        req_id = request.request_id
        state = self._state(req_id)
        state.request = request
        row = self._ledger().blocks(req_id)
        if not row:
            return
        processed = int(request.num_computed_tokens) - int(
            getattr(request, "num_in_flight_tokens", 0) or 0
        )
        before = state.hole
        old_stop = None if before is None else before.stop
        if processed >= int(request.num_prompt_tokens):
            self._claim_for_h2o(req_id, row)
        grown = planner.grow_for_decode(
            req_id,
            row[0].block_id,
            int(request.num_prompt_tokens),
            processed,
            self.step,
            merged=self._h2o_owned(req_id),
        )
        hole = state.hole
        if grown and self.guard is not None:
            # from now on its tokens attend past a hole: not the full prefix's KV
            self.guard.freeze(req_id, processed // self.block_size)
        if grown and hole is not None and planner.decode_recent_blocks is not None:
            # a kept region of sinks only (a tiny prefill pack) has nothing to merge into
            first = hole.start if old_stop is None else old_stop
            fixed = planner.merge_fixed_blocks(int(request.num_prompt_tokens), hole.start)
            if hole.start > fixed and self._h2o_owned(req_id):
                ids = [block.block_id for block in row]  # the merged blocks, before release
                bs = self.block_size
                self._next.merges.append(
                    MergeJob(
                        req_id,
                        tuple(ids[: hole.start]),
                        tuple(ids[first : hole.stop]),
                        fixed * bs,
                        tuple(ids[hole.stop : -(-processed // bs)]),
                        processed - hole.stop * bs,
                    )
                )
        self._release(req_id)

    def _h2o_owned(self, req_id: str) -> bool:
        """H2O scores and merges for this request: always without prefix caching; with it,
        only once the request owns all its blocks, unhashed (:meth:`_claim_for_h2o`): merges
        rewrite its kept region, and its scored rows are found by block 0."""
        if self.planner is None or self.planner.decode_recent_blocks is None:
            return False
        state = self.states.get(req_id)
        return self.guard is None or (state is not None and state.frontier == 0)

    def _claim_for_h2o(self, req_id: str, row: list[Any]) -> None:
        """Prefix caching, H2O decode: when the request decodes and its first block is its
        own (no other request shares any of its blocks: sharing is by prefix), take every
        block out of the cache, so none can be shared later. A request that shares its
        first block decodes as with ``"recent"`` (no scores, no merges) until it owns it."""
        if self.guard is None or self._planner().decode_recent_blocks is None:
            return
        if self._state(req_id).frontier == 0 or not row or row[0].ref_cnt != 1:
            return
        self.guard.freeze(req_id, 0)

    def _state(self, req_id: str) -> RequestState:
        state = self.states.get(req_id)
        if state is None:
            raise RuntimeError(f"request {req_id!r} has blocks but no request state")
        return state

    def _release(self, req_id: str) -> None:
        """Give the visible part of ``req_id``'s hole back to the pool, unless a store load
        the worker has not confirmed (a refused one is recomputed into them) or a pack some
        tensor-parallel rank has not reported still needs its blocks."""
        hole = self._planner().visible(req_id, self.step)
        if hole is None:
            return
        state = self._state(req_id)
        if state.load_start is not None or state.packs_owed:
            return
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
        for a, b in _without(lo, hi, state.released_before):
            released = ledger.release(req_id, a, b)
            state.freed += len(released.freed)
            self.release_stats.blocks_released += len(released.freed)
            self.release_stats.blocks_kept_shared += len(released.kept)
        state.released_to = hi

    def _protected_blocks(self, state: RequestState, row: list[Any], prompt_len: int) -> int:
        """Leading prompt blocks a pack must leave alone (0 without prefix caching): those
        vLLM's cache served this request (other requests may hit them again) and, up to
        the last one, those another request holds too (it reads them through a hit)."""
        if self.guard is None:
            return 0
        full = prompt_len // self.block_size
        protected = min(state.hit_blocks, full)
        for index in range(full - 1, protected - 1, -1):
            if row[index].ref_cnt > 1:
                return index + 1
        return protected

    def _plan_capture(
        self, req_id: str, row: list[Any], prompt_len: int, lo: int, hi: int, meta: StepMetadata
    ) -> None:
        bs = self.block_size
        window_lo = max(prompt_len - self.config.window, lo)
        window_hi = min(hi, prompt_len)
        if window_lo >= window_hi:
            return
        positions = list(range(window_lo, window_hi))
        slots = [int(row[p // bs].block_id) * bs + p % bs for p in positions]
        meta.captures.append(CaptureSpec(req_id, slots, positions))

    # ------------------------------------------------------------------ admission
    def _shape(self, request: Any) -> RequestShape:
        """What bounds the request's blocks (:mod:`lmcompact.compaction.admission`): its
        hole as planned, or as a fresh prompt would get it; its decode budget when its
        hole can grow (a compacted store load's hole is never grown: no budget then)."""
        planner = self._planner()
        prompt_len = int(request.num_prompt_tokens)
        max_tokens = getattr(request, "max_tokens", None)
        state = self.states.get(request.request_id)
        hole = None if state is None else state.hole
        if hole is not None:
            kept, length, grows = hole.start, hole.length, hole.owned
            protected = planner.protected_blocks(prompt_len, hole.start)
        else:
            kept, length = planner.fresh_hole(prompt_len)
            protected = planner.protected_blocks(prompt_len, kept if length else None)
            # a compacted load about to be allocated opens a hole the budget cannot grow
            loading = state is not None and state.pending > 0
            grows = not (loading and self.slots < self.config.store.chunk_size)
        return RequestShape(
            prompt_tokens=prompt_len,
            max_tokens=None if max_tokens is None else int(max_tokens),
            block_size=self.block_size,
            hole_blocks=length,
            kept_blocks=kept,
            decode_budget_blocks=planner.decode_budget_blocks if grows else None,
            protected_blocks=protected,
            lookahead_tokens=self.spec.facts.lookahead_tokens,
            prompt_computed=int(request.num_computed_tokens) >= prompt_len,
        )

    def _own_blocks(self, req_id: str) -> int:
        """Blocks the request holds that no other request shares (what the pool gets back)."""
        return sum(
            1 for block in self._ledger().blocks(req_id) if not block.is_null and block.ref_cnt == 1
        )

    def pending_blocks(self, request: Any) -> int:
        """Blocks a running request may still take from the pool (see the module doc)."""
        peak = self._shape(request).peak_blocks
        return admission.pending_blocks(peak, self._own_blocks(request.request_id))

    def admits(self, request: Any) -> bool:
        """Whether a request may get blocks now (always, unless it is a new admission that
        would eat the blocks reserved for running requests to reach their peaks)."""
        if not self.reserve_growth or self.ledger is None:
            return True
        ledger = self.ledger
        if ledger.blocks(request.request_id):
            return True  # already running: its peak was reserved
        running = [
            state.request
            for rid, state in self.states.items()
            if state.request is not None and rid != request.request_id
        ]
        if not running:
            return True
        need = self._shape(request).peak_blocks
        if admission.admits(ledger.num_free(), need, map(self.pending_blocks, running)):
            return True
        self.release_stats.admissions_deferred += 1
        return False


def _without(lo: int, hi: int, gone: tuple[int, int] | None) -> list[tuple[int, int]]:
    """The non-empty parts of ``[lo, hi)`` outside ``gone``."""
    if gone is None:
        return [(lo, hi)]
    parts = [(lo, min(hi, gone[0])), (max(lo, gone[1]), hi)]
    return [(a, b) for a, b in parts if a < b]
