"""What the parts of the scheduler half share: one :class:`TrackedRequest` per live request
and the :class:`SchedulerState` base that declares the half's attributes once.

:class:`lmcompact.vllm.scheduler_side.SchedulerHalf` sets these in its constructor; its parts
(:mod:`scheduler_lookup`: lookups and worker reports, :mod:`scheduler_saves`: captures and
saves) read them through this base, so the type checker sees one declaration.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lmcompact.policies import CompactionPolicy
from lmcompact.store import ChunkKey, ChunkKeyer, TieredStore
from lmcompact.vllm import vllm_shim as shim
from lmcompact.vllm.config import ConnectorConfig
from lmcompact.vllm.holes import Hole
from lmcompact.vllm.reconstruct import ReconstructRequest


@dataclass
class TrackedRequest:
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


class SchedulerState:
    """Attributes of the scheduler half that its parts use."""

    config: ConnectorConfig
    facts: shim.EngineFacts
    store: TieredStore
    rank_stores: list[TieredStore]
    keyer: ChunkKeyer
    kept: int
    save_wait_s: float
    policy: CompactionPolicy
    tp_size: int
    stats: dict[str, int]
    _requests: dict[str, TrackedRequest]
    _reported: set[ChunkKey]
    _saving: dict[ChunkKey, float]
    _version: int
    frontier_of: Callable[[str], int | None] | None

    # defined by SchedulerHalf and StoreLookup (declared here for the type checker; never
    # reached)
    def _track(self, request: Any) -> TrackedRequest:
        raise NotImplementedError

    def _present(self, tracked: TrackedRequest, first: int, last: int) -> int:
        raise NotImplementedError

    def _slices(self, key: ChunkKey) -> tuple[ChunkKey, ...]:
        raise NotImplementedError

    def _save_in_flight(self, key: ChunkKey) -> bool:
        raise NotImplementedError
