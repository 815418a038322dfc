"""The only channel from the scheduler half to the worker half: one dataclass per step.

The scheduler half decides everything (what to load where, which queries to capture, what
to save, which rows have holes); the worker half executes it and keeps no request state of
its own beyond the queries it is collecting for a pending save.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from connectors.holes import Hole
from lmcompact.store import ChunkKey, CompactedChunk


@dataclass
class LoadSpec:
    """Write stored chunks into a request's blocks (packed: kept tokens first).

    Attributes:
        req_id: request id.
        block_ids: the request's block table row (logical block -> physical block).
        start: first logical token the chunks cover (a chunk boundary).
        chunks: validated chunks, in order; chunk ``i`` covers tokens
            ``start + i * chunk_size ..``; its kept rows go to slots
            ``start + i * kept .. start + (i + 1) * kept``.
    """

    req_id: str
    block_ids: list[int]
    start: int
    chunks: list[CompactedChunk]


@dataclass
class CaptureSpec:
    """Copy the queries of some of a request's tokens computed this step (window queries).

    Attributes:
        req_id: request id.
        slots: physical KV slots (``block * block_size + offset``) of the wanted tokens.
        positions: their logical positions, same order.
    """

    req_id: str
    slots: list[int]
    positions: list[int]


@dataclass
class SaveSpec:
    """After this step's forward pass, copy a request's pages and compact them off-thread.

    Attributes:
        req_id: request id.
        block_ids: the request's block table row.
        keys: store keys of the chunks to save.
        start: first token of the first chunk to save.
        num_tokens: tokens from ``start`` whose KV is in the cache after this step.
    """

    req_id: str
    block_ids: list[int]
    keys: list[ChunkKey]
    start: int
    num_tokens: int


@dataclass
class StepMetadata:
    """What the worker half does in one engine step.

    Attributes:
        loads: chunks to write before the forward pass.
        captures: window queries to copy during the forward pass.
        saves: spans to store after the forward pass.
        holes: hole per first physical block id, for every scheduled row that has one.
        finished: ids of requests that finished (drop their pending captures).
    """

    loads: list[LoadSpec] = field(default_factory=list)
    captures: list[CaptureSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    holes: dict[int, Hole] = field(default_factory=dict)
    finished: set[str] = field(default_factory=set)

    def is_idle(self) -> bool:
        return not (self.loads or self.captures or self.saves or self.holes or self.finished)
