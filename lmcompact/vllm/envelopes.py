"""The vLLM-typed envelopes the connector's halves exchange each step.

:class:`LMCompactMetadata` carries the scheduler's plan to the workers (ids and block
numbers, never KV); :class:`LMCompactWorkerMetadata` carries each worker's
:class:`~lmcompact.vllm.metadata.WorkerReport` back.
"""

from __future__ import annotations

from typing import Any

from lmcompact.vllm import vllm_shim as shim
from lmcompact.vllm.memory.heavy_hitters import MergeJob
from lmcompact.vllm.memory.scheduler_state import PackJob
from lmcompact.vllm.metadata import StepMetadata, WorkerReport


class LMCompactMetadata(shim.KVConnectorMetadata):  # type: ignore[misc]
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


class LMCompactWorkerMetadata(shim.KVConnectorWorkerMetadata):  # type: ignore[misc]
    """vLLM-typed envelope of one :class:`WorkerReport` (worker -> scheduler)."""

    def __init__(self, report: WorkerReport) -> None:
        self.report = report

    def aggregate(self, other: Any) -> LMCompactWorkerMetadata:
        # under tensor parallelism every rank reports the step: a union is exact, because
        # each rank reports its own slice keys (ChunkKey.for_rank) and its rank with packs
        if isinstance(other, LMCompactWorkerMetadata):
            self.report.merge(other.report)
        return self
