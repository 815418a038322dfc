"""Return a running request's hole blocks to vLLM's block pool, and audit the pool.

vLLM keeps, per request and per KV-cache group, a list of blocks indexed by logical block
(``req_to_blocks[req_id][i]`` holds tokens ``[i * bs, (i + 1) * bs)``). Allocation only
looks at the list's *length* (``cdiv(num_tokens, bs) - len(list)`` new blocks), so a
block in the middle can be given back by putting the pool's shared ``null_block`` in its
place and freeing it, exactly as vLLM's sliding-window managers do for tokens that left
their window::

    before   req_to_blocks[r] = [ 7  9 | 12 15 21 | 30 31 ]   held 7 blocks
    release(r, 2, 5)
    after    req_to_blocks[r] = [ 7  9 | N  N  N  | 30 31 ]   held 4, pool +3
                                         ^ null_block (never freed, never counted)

The list keeps its length, so vLLM's next allocation, its finish/abort/preempt path
(``free_blocks`` skips the null block) and the worker's block-table row stay consistent;
attention never reads those columns because the hole is cut out of the per-layer block
table (:mod:`connectors.holes`).

Only blocks this request owns alone are released: ``ref_cnt == 1`` and no prefix-cache
hash. A shared or hashed block stays in the list (the request keeps its reference; vLLM
drops it at finish). A null block or a non-positive reference count inside a range this
module is asked to release is an accounting error and raises.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any


class BlockAccountingError(RuntimeError):
    """vLLM's block bookkeeping is not what the release path expects."""


@dataclass(frozen=True)
class Released:
    """Outcome of one release call.

    Attributes:
        freed: physical ids returned to the pool.
        kept: physical ids left in place because they are shared or prefix-cached.
    """

    freed: tuple[int, ...]
    kept: tuple[int, ...]


class BlockLedger:
    """Scheduler-side view of one engine's KV block pool (KV-cache group 0).

    Args:
        kv_cache_manager: vLLM's ``KVCacheManager`` (handed to connectors through
            ``bind_kv_cache_manager``).

    Raises:
        ValueError: the engine has more than one KV-cache group (hybrid models), which this
            release path does not cover.
    """

    def __init__(self, kv_cache_manager: Any) -> None:
        managers = kv_cache_manager.coordinator.single_type_managers
        if len(managers) != 1:
            raise ValueError(
                f"memory release supports one KV-cache group (full attention), got {len(managers)}"
            )
        self.manager = kv_cache_manager
        self.group = managers[0]
        self.pool = kv_cache_manager.block_pool
        self.null_block = self.pool.null_block

    # ------------------------------------------------------------------ queries
    def blocks(self, req_id: str) -> list[Any]:
        """The request's block list (the live vLLM object; empty when unknown)."""
        return self.group.req_to_blocks.get(req_id, [])

    def block_ids(self, req_id: str) -> list[int]:
        return [block.block_id for block in self.blocks(req_id)]

    def held(self, req_id: str) -> int:
        """Blocks the request really holds (null entries excluded)."""
        return sum(1 for block in self.blocks(req_id) if not block.is_null)

    def num_free(self) -> int:
        return int(self.pool.get_num_free_blocks())

    def is_exclusive(self, block: Any) -> bool:
        """True when ``block`` may be written or returned by its single owner."""
        return not block.is_null and block.ref_cnt == 1 and block.block_hash is None

    # ------------------------------------------------------------------ release
    def release(self, req_id: str, start: int, stop: int) -> Released:
        """Give back the request's blocks ``[start, stop)`` that it owns alone.

        Entries already null (released earlier) are skipped, so a range can be extended
        and released again.

        Raises:
            BlockAccountingError: the request is unknown, the range runs past its list, or a
                block in the range has ``ref_cnt < 1``.
        """
        if req_id not in self.group.req_to_blocks:
            raise BlockAccountingError(f"release of unknown request {req_id!r}")
        row = self.group.req_to_blocks[req_id]
        if not 0 <= start <= stop <= len(row):
            raise BlockAccountingError(
                f"release [{start}, {stop}) of {req_id!r} outside its {len(row)} blocks"
            )
        freed: list[Any] = []
        kept: list[int] = []
        for index in range(stop - 1, start - 1, -1):
            block = row[index]
            if block.is_null:
                continue
            if block.ref_cnt < 1:
                raise BlockAccountingError(
                    f"block {block.block_id} of {req_id!r} has ref_cnt {block.ref_cnt}"
                )
            if not self.is_exclusive(block):
                kept.append(block.block_id)
                continue
            row[index] = self.null_block
            freed.append(block)
        if freed:
            self.pool.free_blocks(freed)
        return Released(tuple(b.block_id for b in freed), tuple(reversed(kept)))


# ---------------------------------------------------------------------- audit
@dataclass(frozen=True)
class PoolAudit:
    """Consistency report of a block pool.

    Attributes:
        num_blocks: blocks in the pool, the null block included.
        num_free: blocks in the free queue.
        referenced: distinct non-null blocks held by live requests.
        free_and_referenced: ids both in the free queue and held by a request.
        ref_mismatch: ``(id, ref_cnt, holders)`` where the count differs from the number
            of request lists holding the block (only meaningful without prefix caching;
            cached blocks held by nobody have ref_cnt 0 and are not listed).
        null_in_free: True if the null block sits in the free queue.
    """

    num_blocks: int
    num_free: int
    referenced: int
    free_and_referenced: tuple[int, ...]
    ref_mismatch: tuple[tuple[int, int, int], ...]
    null_in_free: bool

    @property
    def ok(self) -> bool:
        return not (self.free_and_referenced or self.ref_mismatch or self.null_in_free)


def audit_pool(kv_cache_manager: Any) -> PoolAudit:
    """Cross-check the free queue against every request's block list (tests, benchmarks)."""
    pool = kv_cache_manager.block_pool
    free_ids = {b.block_id for b in pool.free_block_queue.get_all_free_blocks()}
    holders: Counter[int] = Counter()
    for manager in kv_cache_manager.coordinator.single_type_managers:
        for row in manager.req_to_blocks.values():
            holders.update(b.block_id for b in row if not b.is_null)
    mismatch = tuple(
        (bid, int(pool.blocks[bid].ref_cnt), n)
        for bid, n in sorted(holders.items())
        if pool.blocks[bid].ref_cnt != n
    )
    return PoolAudit(
        num_blocks=len(pool.blocks),
        num_free=int(pool.get_num_free_blocks()),
        referenced=len(holders),
        free_and_referenced=tuple(sorted(free_ids & set(holders))),
        ref_mismatch=mismatch,
        null_in_free=pool.null_block.block_id in free_ids,
    )
