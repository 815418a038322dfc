"""Scheduler half of the connector: finds stored prefixes and plans loads, captures, saves.

Cheap and free of store I/O on the engine's scheduling loop: it asks which chunks exist
(an index lookup, cached per request, never a payload fetch or a checksum) and describes
each step's work in one :class:`~lmcompact.vllm.metadata.StepMetadata` that names chunks by
key. The worker half fetches and verifies them; a chunk that turns out missing or bad
there is reported back and the request is recomputed (vLLM's ``kv_load_failure_policy``
"recompute"), never loaded wrong.

What exists is the union of two views: the store's own index (shared with the worker when
both halves run in one process; Redis is shared across processes) and the keys the worker
reports as stored (:class:`~lmcompact.vllm.metadata.WorkerReport`; the only view of a worker's
private CPU tier under vLLM's multiprocess engine). A request whose next chunk is still
being saved by the worker waits (``None`` to vLLM: "ask again") until the save is reported
or ``save_wait_s`` passes, so a prompt repeated right after its first request is a hit.

Tensor parallel: every rank stores its slice of a chunk under its own key
(:meth:`~lmcompact.store.ChunkKey.for_rank`) and reports it; a chunk exists only when every
rank's slice does (in the reports or the store's index), and its save is in flight until
every rank reported its slice.

Packed load of ``n`` chunks of ``C`` tokens keeping ``K`` each, starting at token ``s``::

    logical tokens  s ........................ s+n*C | computed by vLLM ->
    slots           [ kept c0 | kept c1 | .. ][ hole: (C-K)*n tokens ][ tail .. ]
                    s          s+K         s+n*K                    s+n*C

Sliding-window layers also skip slots ``[0, s+(n-1)*K)`` (the hole's ``window_lead``): only
the last chunk's kept rows (its last K tokens) sit at their logical distance from the tail.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from lmcompact.policies import Need
from lmcompact.store import ChunkKey, ChunkKeyer, TieredStore
from lmcompact.vllm import vllm_shim as shim
from lmcompact.vllm.config import ConnectorConfig
from lmcompact.vllm.holes import Hole, keyed_by_last_block
from lmcompact.vllm.metadata import (
    CaptureSpec,
    LoadSpec,
    ReconstructCapture,
    SaveSpec,
    StepMetadata,
    WorkerReport,
)
from lmcompact.vllm.reconstruct import (
    ReconstructRequest,
    reconstruct_request,
    save_allowed,
    token_scores,
)

logger = logging.getLogger(__name__)


@dataclass
class _Tracked:
    """What the scheduler half remembers about one live request."""

    prompt: list[int]
    keys: list[ChunkKey]
    block_ids: list[int] = field(default_factory=list)
    pending: int = 0  # chunks matched by the last lookup, not yet confirmed
    pending_start: int = 0
    confirmed: bool = False
    loaded_end: int = 0
    load_start: int | None = None  # start of a load the worker has not confirmed yet
    hole: Hole | None = None
    saved: bool = False
    looked_up: tuple[int, int, int] | None = None  # (first, last, index version) -> present
    present: int = 0
    capture: list[int] | None = None
    reconstruct: ReconstructRequest | None = None  # a reconstruction pass's parts
    token_scores: list[float] | None = None  # context scores given with the request
    no_save: bool = False  # a scoring request: neither loaded nor stored


class SchedulerHalf:
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
        self.kept = config.kept_per_chunk(facts.block_size)
        self.save_wait_s = save_wait_s
        self.policy = config.store_policy()  # what the saved chunks' compaction reads
        self._requests: dict[str, _Tracked] = {}
        self.tp_size = facts.tp_size
        self._reported: set[ChunkKey] = set()  # slice keys stored, as the workers said
        self._saving: dict[ChunkKey, float] = {}  # slice save planned -> time planned
        self._version = 0  # bumps whenever what is known to exist changes
        # with vLLM's prefix caching: request -> its first block kept out of the cache
        # (None: none); holes of requests whose block 0 may be shared are keyed by the
        # row's last block
        self.frontier_of: Callable[[str], int | None] | None = None
        self.stats = {
            "lookups": 0,
            "store_queries": 0,
            "hit_chunks": 0,
            "waits": 0,
            "wait_timeouts": 0,
            "load_failures": 0,
        }

    # ------------------------------------------------------------------ lookups
    def _track(self, request: Any) -> _Tracked:
        req_id = request.request_id
        tracked = self._requests.get(req_id)
        if tracked is None:
            prompt = shim.request_prompt_ids(request)
            tracked = _Tracked(prompt=prompt, keys=self.keyer.keys(prompt))
            tracked.reconstruct = self._reconstruct_len(request, prompt)
            self._given_scores(request, tracked)
            self._requests[req_id] = tracked
        return tracked

    def _given_scores(self, request: Any, tracked: _Tracked) -> None:
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

    def _present(self, tracked: _Tracked, first: int, last: int) -> int:
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
        ):
            return 0  # a reconstruction or scoring pass computes its whole prompt itself
        first = num_computed // c
        last = (len(tracked.prompt) - 1) // c  # leave >= 1 token for vLLM to compute
        if last <= first:
            return 0
        self.stats["lookups"] += 1
        present = self._present(tracked, first, last)
        if present < last and self._save_in_flight(tracked.keys[present]):
            self.stats["waits"] += 1
            return None
        if present <= first:
            return 0
        tracked.pending, tracked.pending_start = present - first, num_computed
        return tracked.pending * c

    def after_alloc(self, request: Any, num_external_tokens: int) -> None:
        tracked = self._track(request)
        tracked.confirmed = num_external_tokens > 0 and tracked.pending > 0
        if not tracked.confirmed:
            tracked.pending = 0

    def compacted_load_start(self, req_id: str) -> int | None:
        """First token of the load just confirmed for ``req_id`` when its chunks are
        compacted (kept rows where vLLM expects every token), else None."""
        tracked = self._requests.get(req_id)
        if tracked is None or not (tracked.confirmed and tracked.pending):
            return None
        if self.kept >= self.config.store.chunk_size:
            return None
        return tracked.pending_start

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
            tracked = self._requests.get(req_id)
            if tracked is not None:
                tracked.load_start = None
        failed: set[str] = set()
        for req_id in report.load_failed:
            self.stats["load_failures"] += 1
            tracked = self._requests.get(req_id)
            if tracked is None:
                continue
            failed.add(req_id)
            if tracked.load_start is not None:
                tracked.loaded_end = tracked.load_start
            tracked.hole, tracked.load_start = None, None
            tracked.saved = False  # the recompute stores what was missing
        return failed

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
                hole = tracked.hole
                if self.frontier_of is not None and self.frontier_of(sched.req_id) != 0:
                    seq_len = sched.num_computed + sched.num_scheduled
                    hole = keyed_by_last_block(
                        hole, tracked.block_ids, seq_len, self.facts.block_size
                    )
                meta.holes[hole.first_block] = hole
            self._plan_save(sched, tracked, meta)
        for req_id in shim.preempted_req_ids(scheduler_output):
            if req_id in self._requests:
                self._requests[req_id].hole = None
                self._requests[req_id].load_start = None
        meta.finished = shim.finished_req_ids(scheduler_output)
        for req_id in meta.finished:
            self._requests.pop(req_id, None)
        return meta

    def _start(self, sched: shim.ScheduledRequest, tracked: _Tracked, meta: StepMetadata) -> None:
        """A request got (new) blocks: emit its load, if confirmed, and its hole."""
        c, bs = self.config.store.chunk_size, self.facts.block_size
        tracked.hole = None
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
        hole_tokens = count * (c - self.kept)
        logger.info(
            "loading %s from the store: %d prefix tokens as %d kept per (layer, head)%s",
            sched.req_id,
            count * c,
            count * self.kept,
            " (compacted)" if hole_tokens else "",
        )
        if hole_tokens:
            tracked.hole = Hole(
                first_block=tracked.block_ids[0],
                start_block=(start + count * self.kept) // bs,
                num_blocks=hole_tokens // bs,
                window_lead=(start + (count - 1) * self.kept) // bs,
                req_id=sched.req_id,
            )

    def load_unconfirmed(self, req_id: str) -> bool:
        """True while a load of ``req_id`` was sent and the worker has not confirmed it
        (its hole blocks must stay held: a failed load is recomputed into them)."""
        tracked = self._requests.get(req_id)
        return tracked is not None and tracked.load_start is not None

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
        self, sched: shim.ScheduledRequest, tracked: _Tracked, meta: StepMetadata
    ) -> None:
        """Query captures in the steps that compute the wanted prompt positions; the save in
        the step that completes the prompt."""
        if not self.config.store.save or tracked.saved or tracked.no_save:
            return
        c, bs = self.config.store.chunk_size, self.facts.block_size
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
        if first >= n_full:
            return
        if recon is None and tracked.token_scores is None and self.policy.scores_given:
            logger.warning(
                "request %s: policy %r scores with token_scores given with the storing "
                "request (lmcompact.vllm.reconstruct.store_surprisal_context); this one has "
                "none, its %d new chunks are not stored",
                sched.req_id,
                self.config.store_policy_name,
                n_full - first,
            )
            return
        keys = tracked.keys[first:n_full]
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

    def finished(self, req_id: str) -> None:
        self._requests.pop(req_id, None)
