"""Store lookups of the scheduler half: which stored chunks a request can load.

Cheap and free of store I/O on the engine's scheduling loop: it asks which chunks exist
(an index lookup, cached per request, never a payload fetch or a checksum).

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
"""

from __future__ import annotations

import logging
import time
from typing import Any

from lmcompact.store import ChunkKey
from lmcompact.vllm.metadata import WorkerReport
from lmcompact.vllm.request_state import RequestState
from lmcompact.vllm.scheduler_state import SchedulerState

logger = logging.getLogger(__name__)


class StoreLookup(SchedulerState):
    """Lookups (cached per request), load confirmation and worker reports."""

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
            or (num_computed and self.config.store.per_head is not None)
        ):
            # a reconstruction or scoring pass computes its whole prompt itself; per-head
            # loads pack each head's rows from slot 0 (after vLLM's own hits they could not)
            return 0
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
        tracked = self.states.get(req_id)
        if tracked is None or not (tracked.confirmed and tracked.pending):
            return None
        if self.slots >= self.config.store.chunk_size:
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
            tracked = self.states.get(req_id)
            if tracked is not None:
                tracked.load_start = None
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
