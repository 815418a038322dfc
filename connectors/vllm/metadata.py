"""The channels between the connector's halves: one envelope each way per step.

:class:`LMCompactMetadata` (scheduler -> workers) wraps one :class:`StepMetadata` and the
release group's entries; :class:`LMCompactWorkerMetadata` (worker -> scheduler) wraps one
:class:`WorkerReport`. :class:`ReleaseStats` counts the release path on the scheduler.

Scheduler -> worker (:class:`StepMetadata`): the scheduler half decides everything (what to
load where, which queries to capture, what to save, which rows have holes) and names stored
chunks by key only: it never fetches KV, so the metadata carries ids, never tensors. The
worker half executes it, fetching and verifying chunks itself, and keeps no request state of
its own beyond the queries it is collecting for a pending save.

Worker -> scheduler (:class:`WorkerReport`): which chunks the worker stored or failed to
store, and which loads it completed or could not complete. With vLLM's multiprocess engine
the halves live in two processes, so this is how the scheduler learns what the worker's
private tiers hold. Under tensor parallelism vLLM merges every rank's report of a step
(``KVConnectorWorkerMetadata.aggregate``): keys are each rank's slice keys and packs name
their rank, so the union keeps who did what.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import vllm.distributed.kv_transfer.kv_connector.v1.base as connector_api
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from lmcompact.compaction.heavy_hitters import MergeJob
from lmcompact.compaction.holes import Hole
from lmcompact.store import ChunkKey


class _NoWorkerMetadata:
    """Stand-in base where vLLM has no worker -> scheduler metadata (never sent there)."""

    def aggregate(self, other: Any) -> Any:
        return self


KVConnectorWorkerMetadata: type = getattr(
    connector_api, "KVConnectorWorkerMetadata", _NoWorkerMetadata
)
"""Base of worker -> scheduler metadata (vLLM 0.26 and 0.32 have it)."""


@dataclass
class LoadSpec:
    """Fetch stored chunks and write them into a request's blocks (packed: kept first).

    Attributes:
        req_id: request id.
        block_ids: the request's block table row (logical block -> physical block).
        start: first logical token the chunks cover (a chunk boundary).
        keys: store keys of the chunks, in order; chunk ``i`` covers tokens
            ``start + i * chunk_size ..``; its kept rows go to slots
            ``start + i * kept .. start + (i + 1) * kept`` (with ``store.per_head``: each
            layer's heads as dense cells of slots ``[start, start + n * R)``, head after
            head, each its rows of all chunks in order; see ``Worker._write_per_head``).
            The worker fetches and verifies
            them; if any is missing or bad, none is written and the request's blocks from
            ``start`` are reported to vLLM for recomputation.
    """

    req_id: str
    block_ids: list[int]
    start: int
    keys: list[ChunkKey]


@dataclass
class CaptureSpec:
    """Copy the queries of some of a request's tokens computed this step (window queries),
    or, with ``reconstruct``, score them against the request's keys right away.

    Attributes:
        req_id: request id.
        slots: physical KV slots (``block * block_size + offset``) of the wanted tokens.
        positions: their logical positions, same order.
    """

    req_id: str
    slots: list[int]
    positions: list[int]
    reconstruct: ReconstructCapture | None = None


@dataclass
class ReconstructCapture:
    """The captured rows are a reconstruction pass's repeat queries: score them at once.

    Attributes:
        block_ids: the request's block table row (the worker reads its keys from there).
        context_len: ``T``: the first copy, whose keys get the scores.
    """

    block_ids: list[int]
    context_len: int


@dataclass
class SurprisalSpec:
    """Score some prompt tokens of a request computed this step by the model's own
    next-token log-probabilities (in-engine self-information).

    Attributes:
        req_id: request id.
        slots: physical KV slots of the tokens whose final hidden states predict the next.
        positions: their logical positions ``p``, same order; each scores token ``p + 1``.
        next_ids: the prompt's token ids at ``p + 1``.
        prompt_len: the prompt's length (the score array's).
    """

    req_id: str
    slots: list[int]
    positions: list[int]
    next_ids: list[int]
    prompt_len: int


@dataclass
class SaveSpec:
    """After this step's forward pass, copy a request's pages and compact them off-thread.

    Attributes:
        req_id: request id.
        block_ids: the request's block table row.
        keys: store keys of the chunks to save.
        start: first token of the first chunk to save.
        num_tokens: tokens from ``start`` whose KV is in the cache after this step.
        reconstruct: the chunks are a reconstruction pass's first copy: compact them with
            the scores the worker accumulated for this request (``connectors/vllm/reconstruct.py``).
        token_scores: context scores given with the request for its tokens from ``start``
            (every layer and head reads the same; ``self_info``), or None.
    """

    req_id: str
    block_ids: list[int]
    keys: list[ChunkKey]
    start: int
    num_tokens: int
    reconstruct: bool = False
    token_scores: list[float] | None = None


@dataclass
class StepMetadata:
    """What the worker half does in one engine step.

    Attributes:
        loads: chunks to write before the forward pass.
        captures: window queries to copy during the forward pass.
        saves: spans to store after the forward pass.
        holes: hole per first physical block id, for every scheduled row that has one.
        finished: ids of requests that finished (drop their pending captures).
        taken_back: ids of requests vLLM preempted this step (their blocks are gone: a
            later load or recompute starts them again).
        surprisal: prompt tokens to score by the model's next-token log-probabilities.
        index: the step's number (set with ``step_trace`` only; -1 otherwise).
    """

    loads: list[LoadSpec] = field(default_factory=list)
    captures: list[CaptureSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    holes: dict[int, Hole] = field(default_factory=dict)
    finished: set[str] = field(default_factory=set)
    taken_back: set[str] = field(default_factory=set)
    surprisal: list[SurprisalSpec] = field(default_factory=list)
    index: int = -1

    def is_idle(self) -> bool:
        return not (
            self.loads
            or self.captures
            or self.surprisal
            or self.saves
            or self.holes
            or self.finished
            or self.taken_back
        )


@dataclass
class WorkerReport:
    """What the worker half did since its last report (sent after every engine step).

    Attributes:
        saved: keys of chunks now in the worker's store.
        save_failed: keys of chunks whose save failed or was dropped (not stored).
        loaded: requests whose loads were written.
        load_failed: requests whose loads were refused (missing or bad chunk); vLLM
            recomputes them from the load's start.
        missing: keys the worker found missing or bad when loading (stale index entries).
        packed: ``(request id, tensor-parallel rank)`` of in-place packs done (the memory
            connector releases a hole's blocks once every rank packed).

    Keys are store keys of the reporting rank's slices (:meth:`ChunkKey.for_rank`).
    """

    saved: set[ChunkKey] = field(default_factory=set)
    save_failed: set[ChunkKey] = field(default_factory=set)
    loaded: set[str] = field(default_factory=set)
    load_failed: set[str] = field(default_factory=set)
    missing: set[ChunkKey] = field(default_factory=set)
    packed: set[tuple[str, int]] = field(default_factory=set)

    def is_empty(self) -> bool:
        return not (
            self.saved
            or self.save_failed
            or self.loaded
            or self.load_failed
            or self.missing
            or self.packed
        )

    def merge(self, other: WorkerReport) -> None:
        """Add ``other`` (another step, or another worker of the same step) to this one."""
        self.saved |= other.saved
        self.save_failed |= other.save_failed
        self.loaded |= other.loaded
        self.load_failed |= other.load_failed
        self.missing |= other.missing
        self.packed |= other.packed


@dataclass(frozen=True)
class PackJob:
    """Worker job: pack kept tokens of ``[start, start + num_tokens)`` into slots
    ``[start, start + kept)``.

    Attributes:
        req_id: request id.
        block_ids: the request's block row.
        num_tokens: tokens compacted (whole blocks).
        kept: tokens each (layer, head) keeps (whole blocks); the mean with per-head counts.
        reserved: slots each head holds, the hole's start (``kept`` unless per-head).
        start: first token of the span; the blocks before it are shared through vLLM's
            prefix cache and stay untouched (0 without prefix caching).
        hole_tokens: two-stage loads: tokens of the load's hole left out of ``block_ids``
            (the row holds the blocks outside it), so a window query at logical position
            ``p`` sits at row slot ``p - hole_tokens``.
    """

    req_id: str
    block_ids: list[int]
    num_tokens: int
    kept: int
    reserved: int
    start: int = 0
    hole_tokens: int = 0


class LMCompactMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """vLLM-typed envelope of one step's plan: the store path's :class:`StepMetadata`, and
    the release group's entries: this step's in-place packs, the requests whose blocks
    vLLM took back since the last step (the worker drops their per-head counts and H2O
    scores), and H2O decode: merges to run before the forward pass and the requests whose
    decode attention is scored (first block -> request id)."""

    def __init__(
        self,
        step: StepMetadata,
        packs: list[PackJob] | None = None,
        forgotten: set[str] | None = None,
        merges: list[MergeJob] | None = None,
        scored: dict[int, str] | None = None,
    ) -> None:
        self.step = step
        self.packs = packs or []
        self.forgotten = forgotten or set()
        self.merges = merges or []
        self.scored = scored or {}


class LMCompactWorkerMetadata(KVConnectorWorkerMetadata):  # type: ignore[misc]
    """vLLM-typed envelope of one :class:`WorkerReport` (worker -> scheduler)."""

    def __init__(self, report: WorkerReport) -> None:
        self.report = report

    def aggregate(self, other: Any) -> LMCompactWorkerMetadata:
        # under tensor parallelism every rank reports the step: a union is exact, because
        # each rank reports its own slice keys (ChunkKey.for_rank) and its rank with packs
        if isinstance(other, LMCompactWorkerMetadata):
            self.report.merge(other.report)
        return self


def worker_metadata(connector_output: Any) -> Any:
    """The aggregated worker metadata of one step's ``KVConnectorOutput``, or None."""
    return getattr(connector_output, "kv_connector_worker_meta", None)
