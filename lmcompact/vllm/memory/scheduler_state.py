"""What the parts of the release group's scheduler share: its jobs and counters
(:class:`PackJob`, :class:`MemoryStats`) and the :class:`MemorySchedulerState` base that
declares the attributes of :class:`lmcompact.vllm.memory.scheduler_side.MemoryScheduler`
once, so its parts (:mod:`lmcompact.vllm.memory.admission`) type-check against one
declaration.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lmcompact.vllm.memory.blocks import BlockLedger, PrefixCacheGuard
from lmcompact.vllm.memory.heavy_hitters import MergeJob
from lmcompact.vllm.memory.planner import HolePlanner
from lmcompact.vllm.memory.rank_packs import RankPacks
from lmcompact.vllm.request_state import RequestStates


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
    """

    req_id: str
    block_ids: list[int]
    num_tokens: int
    kept: int
    reserved: int
    start: int = 0


@dataclass
class MemoryStats:
    """Counters of the release path (read by tests and the capacity benchmark)."""

    packs: int = 0
    blocks_released: int = 0
    blocks_kept_shared: int = 0
    holes_adopted: int = 0  # compacted store loads whose holes this group gives back
    repacks: int = 0
    preemptions: int = 0
    admissions_deferred: int = 0
    protected_blocks: int = 0  # prompt blocks packs left untouched (prefix caching)
    peak_held: dict[str, int] = field(default_factory=dict)


class MemorySchedulerState:
    """Attributes of the memory scheduler that its parts use, and the ledger accessor."""

    planner: HolePlanner
    states: RequestStates
    block_size: int
    window: int
    capture: bool
    ledger: BlockLedger | None
    forgotten: set[str]
    merges: list[MergeJob]
    scored: dict[int, str]
    reserve_growth: bool
    rank_packs: RankPacks
    stats: MemoryStats
    guard: PrefixCacheGuard | None

    def _ledger(self) -> BlockLedger:
        if self.ledger is None:
            # without the manager no block can be released: refuse instead of saving nothing
            raise RuntimeError(
                "the release group was never bound to vLLM's KVCacheManager (neither "
                "bind_kv_cache_manager nor bind_gpu_block_pool was called)"
            )
        return self.ledger
