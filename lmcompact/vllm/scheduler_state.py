"""What the parts of the scheduler half share: the :class:`SchedulerState` base that declares
the half's attributes once (among them the one
:class:`~lmcompact.vllm.request_state.RequestState` per live request, in ``states``).

:class:`lmcompact.vllm.scheduler_side.SchedulerHalf` sets these in its constructor; its parts
(:mod:`scheduler_lookup`: lookups and worker reports, :mod:`scheduler_saves`: captures and
saves) read them through this base, so the type checker sees one declaration.
"""

from __future__ import annotations

from typing import Any

from lmcompact.policies import CompactionPolicy
from lmcompact.store import ChunkKey, ChunkKeyer, TieredStore
from lmcompact.vllm import vllm_shim as shim
from lmcompact.vllm.config import ConnectorConfig
from lmcompact.vllm.request_state import RequestState, RequestStates


class SchedulerState:
    """Attributes of the scheduler half that its parts use."""

    config: ConnectorConfig
    facts: shim.EngineFacts
    store: TieredStore
    rank_stores: list[TieredStore]
    keyer: ChunkKeyer
    slots: int  # slots one loaded chunk takes in a block row (K, or the per-head cap)
    save_wait_s: float
    policy: CompactionPolicy
    tp_size: int
    stats: dict[str, int]
    states: RequestStates
    _reported: set[ChunkKey]
    _saving: dict[ChunkKey, float]
    _version: int

    # defined by SchedulerHalf and StoreLookup (declared here for the type checker; never
    # reached)
    def _track(self, request: Any) -> RequestState:
        raise NotImplementedError

    def _present(self, tracked: RequestState, first: int, last: int) -> int:
        raise NotImplementedError

    def _slices(self, key: ChunkKey) -> tuple[ChunkKey, ...]:
        raise NotImplementedError

    def _save_in_flight(self, key: ChunkKey) -> bool:
        raise NotImplementedError
