"""The scheduler side's one record per live request.

Every request the scheduler connector sees has one :class:`RequestState` in one
:class:`RequestStates` (owned by :class:`connectors.vllm.scheduler.Scheduler`; no other
scheduler-side object keeps anything per request): its
prompt and chunk keys, its block row as vLLM hands it over, what the store half plans for it
(lookups, a load, captures, a save) and at most one :class:`HoleState`. Whoever opens the hole
writes it there: the store path when a compacted load packs kept rows into the first blocks
(``owned=False``: never grown), the release group's
:class:`~lmcompact.compaction.hole_planner.HolePlanner` at prefill end or during decode. The
release group reads the same record to give the hole's blocks back; once per step every
scheduled request's visible hole goes to the worker in its wire form
(:class:`lmcompact.compaction.holes.Hole`). With vLLM's prefix caching the record also holds
the request's cache frontier (:class:`connectors.vllm.patches.kv_cache_manager.PrefixCacheGuard`
reads and writes it there), and under tensor parallelism the ranks that still owe the report
of its last in-place pack.

Two events end parts of a record, through one path (:meth:`RequestStates.forget`):

* vLLM took the request's blocks back (preemption; the release group also sees frees of
  finished and aborted requests): the hole, the unconfirmed load and the release bookkeeping
  go; what the request is (prompt, keys, options, whether it was saved) stays for its resume;
* the request finished or was aborted: the whole record goes.
"""

from __future__ import annotations

from collections.abc import Iterator, MutableMapping
from dataclasses import dataclass, field
from typing import Any

from connectors.vllm.disaggregation import StoredPrefix
from connectors.vllm.reconstruct import ReconstructRequest
from lmcompact.compaction.holes import HoleState
from lmcompact.store import ChunkKey

__all__ = ["HoleState", "HoleTable", "RequestState", "RequestStates"]


@dataclass
class RequestState:
    """What the scheduler side remembers about one live request.

    Attributes:
        prompt: prompt token ids.
        keys: chunk keys of the prompt's full chunks.
        block_ids: the request's block row (logical block -> physical id), as vLLM sent it.
        pending: chunks matched by the last lookup, not yet confirmed by an allocation.
        pending_start: first token of those chunks.
        confirmed: vLLM allocated blocks for the pending chunks.
        loaded_end: end of the prefix loaded from the store (or served by vLLM's cache).
        load_start: start of a load the worker has not confirmed yet (None: none).
        hole: the request's one hole (None: none).
        saved: its save was planned (or it needs none).
        looked_up: ``(first, last, index version)`` of the cached lookup, and ``present``
            its answer.
        capture: prompt positions whose queries the worker copies for the save.
        reconstruct: a reconstruction pass's parts.
        token_scores: context scores given with the request.
        no_save: a scoring request: neither loaded nor stored.
        released_to: release group: hole blocks below this logical index went back already.
        released_before: release group, two-stage loads: logical blocks ``[lo, hi)`` given back
            under the load's hole before the request's own pack replaced it (skipped by
            later releases; None: none).
        previous_hole: two-stage loads: the load's hole, which attention still skips until
            the pack's hole (``hole``) is visible.
        freed: release group: blocks of this request given back to the pool.
        hit_blocks: release group: leading blocks vLLM's prefix cache served the request.
        packed: release group: the prompt was packed in place at least once.
        request: release group: vLLM's request object while it holds blocks (None: it
            holds none).
        packs_owed: release group, tensor parallel: ranks that have not reported the last
            planned pack (its hole blocks stay held until none does).
        frontier: prefix caching: the first logical block that is not the full-prefix KV of
            its tokens (never hashed again; None: all are).
        seq_len: keys of the request in the step being planned (None: not scheduled).
        stored_chunks: leading prompt chunks in the store or being saved once its save is
            planned (what a ``kv_producer`` tells the consumer).
        remote: ``kv_consumer``: what the producer stored for it (None: nothing said).
        remote_since: ``kv_consumer``: when it began waiting for those chunks (None: not).
        remote_checked: ``kv_consumer``: when the store was last asked for them.
    """

    prompt: list[int]
    keys: list[ChunkKey]
    block_ids: list[int] = field(default_factory=list)
    pending: int = 0
    pending_start: int = 0
    confirmed: bool = False
    loaded_end: int = 0
    load_start: int | None = None
    hole: HoleState | None = None
    saved: bool = False
    looked_up: tuple[int, int, int] | None = None
    present: int = 0
    capture: list[int] | None = None
    reconstruct: ReconstructRequest | None = None
    token_scores: list[float] | None = None
    no_save: bool = False
    released_to: int | None = None
    released_before: tuple[int, int] | None = None
    previous_hole: HoleState | None = None
    freed: int = 0
    hit_blocks: int = 0
    packed: bool = False
    request: Any = None
    packs_owed: set[int] = field(default_factory=set)
    frontier: int | None = None
    seq_len: int | None = None
    stored_chunks: int = 0
    remote: StoredPrefix | None = None
    remote_since: float | None = None
    remote_checked: float = 0.0

    def drop_hole(self) -> None:
        """The hole is gone before any of its blocks went back (a refused load: vLLM
        recomputes into the blocks the request still holds)."""
        self.hole = None
        self.previous_hole = None
        self.released_to = None
        self.released_before = None
        self.freed = 0

    def drop_blocks(self) -> None:
        """vLLM took every block of the request back: nothing planned on them stays."""
        self.drop_hole()
        self.load_start = None
        self.hit_blocks = 0
        self.request = None
        self.frontier = None


class RequestStates:
    """The scheduler side's records, one per live request, and the step counter."""

    def __init__(self) -> None:
        self._states: dict[str, RequestState] = {}
        self.step = 0
        """Steps whose metadata was built (holes are visible from a step on)."""
        self.holes = HoleTable(self)
        """The same holes, as a ``request id -> HoleState`` mapping (the release planner's)."""

    def get(self, req_id: str) -> RequestState | None:
        return self._states.get(req_id)

    def __getitem__(self, req_id: str) -> RequestState:
        return self._states[req_id]

    def __contains__(self, req_id: object) -> bool:
        return req_id in self._states

    def __len__(self) -> int:
        return len(self._states)

    def add(self, req_id: str, state: RequestState) -> RequestState:
        self._states[req_id] = state
        return state

    def items(self) -> Iterator[tuple[str, RequestState]]:
        return iter(list(self._states.items()))

    def forget(self, req_id: str, finished: bool) -> None:
        """vLLM took ``req_id``'s blocks back; with ``finished`` the request is gone too."""
        state = self._states.get(req_id)
        if state is None:
            return
        state.drop_blocks()
        if finished:
            del self._states[req_id]


class HoleTable(MutableMapping[str, HoleState]):
    """``request id -> HoleState`` over the records of a :class:`RequestStates`: the
    holes live in the records; this is a view the hole planner reads and writes."""

    def __init__(self, states: RequestStates) -> None:
        self._states = states

    def __getitem__(self, req_id: str) -> HoleState:
        state = self._states.get(req_id)
        if state is None or state.hole is None:
            raise KeyError(req_id)
        return state.hole

    def __setitem__(self, req_id: str, hole: HoleState) -> None:
        state = self._states.get(req_id)
        if state is None:
            raise KeyError(f"no request state for {req_id!r}: a hole needs a tracked request")
        state.hole = hole

    def __delitem__(self, req_id: str) -> None:
        state = self._states.get(req_id)
        if state is None or state.hole is None:
            raise KeyError(req_id)
        state.hole = None

    def __iter__(self) -> Iterator[str]:
        return iter([req_id for req_id, state in self._states.items() if state.hole is not None])

    def __len__(self) -> int:
        return sum(1 for _ in self)
