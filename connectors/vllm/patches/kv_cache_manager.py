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
table (:mod:`lmcompact.compaction.holes`).

Only blocks this request owns alone (``ref_cnt == 1``) are released. A shared block stays
in the list (the request keeps its reference; vLLM drops it at finish), so a block another
request reads through a prefix-cache hit is neither freed twice nor handed out while read.
A released block that still carries a prefix-cache hash goes back as a cached free block
(vLLM evicts its hash when it hands it out again): :class:`PrefixCacheGuard` removes the
hash of every block whose contents are not the full-prefix KV of its tokens first, so only
exact blocks keep one. A null block or a non-positive reference count inside a range this
module is asked to release is an accounting error and raises.

With vLLM's prefix caching on, :class:`PrefixCacheGuard` keeps compacted KV out of the
cache. Per compacted request it keeps a *frontier*: the first logical block whose contents
are not the full-prefix KV of its tokens (a packed block, a block of a compacted store load,
or any block computed while attention skipped a hole). Blocks from the frontier on lose
their hash when the frontier is set and are never hashed again::

    req_to_blocks[r] = [ 7  9 | 12 15 21 30 ]     frontier 2 (a pack rewrites 12, 15)
    hashed           = [ y  y |  -  -  -  -  ]     hits on 7, 9 stay; 12.. never hit
"""

from __future__ import annotations

import weakref
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from functools import wraps
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
        """True when ``block`` may be returned by its single owner (a hash it still carries
        is exact: :class:`PrefixCacheGuard` removed every other)."""
        return not block.is_null and block.ref_cnt == 1

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


class PrefixCacheGuard:
    """Keeps compacted KV out of vLLM's prefix cache (scheduler side, KV-cache group 0).

    vLLM hashes a request's full blocks as soon as they are scheduled
    (``KVCacheManager.allocate_slots`` -> ``coordinator.cache_blocks``), and a later request
    whose prompt starts with the same tokens reads them as the full prefix. A compacted
    request breaks that: a pack rewrites its blocks in place, a compacted store load writes
    kept rows where vLLM expects every token, and every token computed while attention skips
    a hole attends to fewer keys than the full prefix. :meth:`freeze` sets a request's
    frontier (the first block that is not the full-prefix KV of its tokens): hashes of the
    blocks it owns alone from there on are removed at once, and the wrapped
    ``coordinator.cache_blocks`` hashes that request only up to the frontier from then on.
    Blocks before the frontier (vLLM's own hits, a shared system prompt, a prompt that was
    only cut into holes) keep their hashes and their hits. vLLM freeing the request (finish,
    abort, preemption) drops its frontier: a recomputed request is exact again.

    Args:
        kv_cache_manager: vLLM's ``KVCacheManager``; its ``coordinator`` instance gets
            ``cache_blocks``, ``free`` and ``pop_blocks_for_free`` wrapped, once.
        records: the scheduler's request records; each request's frontier lives in its
            record (``frontier``), which :meth:`freeze` creates when missing.

    Raises:
        ValueError: more than one KV-cache group, or a coordinator without those methods.
    """

    WRAPPED = ("cache_blocks", "free", "pop_blocks_for_free")

    def __init__(self, kv_cache_manager: Any, records: Any) -> None:
        coordinator = kv_cache_manager.coordinator
        managers = coordinator.single_type_managers
        if len(managers) != 1:
            raise ValueError(
                "prefix caching with a compacting connector supports one KV-cache group "
                f"(full attention), got {len(managers)}"
            )
        missing = [name for name in self.WRAPPED if not callable(getattr(coordinator, name, None))]
        if not callable(getattr(kv_cache_manager.block_pool, "_maybe_evict_cached_block", None)):
            missing.append("block_pool._maybe_evict_cached_block")
        if missing:
            raise ValueError(
                f"vLLM's KV-cache coordinator has no {missing}: cannot keep compacted blocks "
                "out of the prefix cache; start vLLM with enable_prefix_caching=False"
            )
        if getattr(coordinator, "_lmcompact_guard", None) is not None:
            raise ValueError("this KVCacheManager already has a prefix-cache guard bound")
        coordinator._lmcompact_guard = self
        self.group = managers[0]
        self.pool = kv_cache_manager.block_pool
        self.block_size = int(self.group.block_size)
        self.records = records
        self.unhashed = 0  # blocks whose hash a freeze removed (tests, logs)
        cache_blocks, free, pop = (getattr(coordinator, name) for name in self.WRAPPED)

        @wraps(cache_blocks)
        def capped_cache_blocks(request: Any, num_computed_tokens: int) -> None:
            frontier = self.frontier(request.request_id)
            if frontier is not None:
                num_computed_tokens = min(num_computed_tokens, frontier * self.block_size)
            cache_blocks(request, num_computed_tokens)

        @wraps(free)
        def free_request(request_id: str) -> None:
            self._drop(request_id)
            free(request_id)

        @wraps(pop)
        def pop_blocks_for_free(request_id: str) -> Any:
            self._drop(request_id)
            return pop(request_id)

        coordinator.cache_blocks = capped_cache_blocks
        coordinator.free = free_request
        coordinator.pop_blocks_for_free = pop_blocks_for_free

    def frontier(self, req_id: str) -> int | None:
        record = self.records.get(req_id)
        return None if record is None else record.frontier

    def _drop(self, req_id: str) -> None:
        """vLLM frees the request's blocks: a recomputed request is exact again."""
        record = self.records.get(req_id)
        if record is not None:
            record.frontier = None

    def freeze(self, req_id: str, from_block: int) -> int:
        """No block of ``req_id`` from logical ``from_block`` on is (or will be) hashed.

        Hashes of the blocks it owns alone there are removed now; a block another request
        also holds keeps its hash (it is that request's exact prefix too, and nobody may
        rewrite it: callers pack only blocks they own alone).

        Returns:
            The request's frontier (the smallest one asked so far).
        """
        if from_block < 0:
            raise ValueError(f"freeze of {req_id!r} from block {from_block}")
        record = self.records.get(req_id)
        if record is None:
            raise RuntimeError(f"freeze of {req_id!r}: the scheduler has no record of it")
        old = record.frontier
        frontier = from_block if old is None else min(from_block, old)
        record.frontier = frontier
        for block in self.group.req_to_blocks.get(req_id, [])[frontier:]:
            if not block.is_null and block.ref_cnt == 1 and block.block_hash is not None:
                self.pool._maybe_evict_cached_block(block)
                self.unhashed += 1
        return frontier

    def violations(self) -> list[tuple[str, int, int]]:
        """``(req_id, logical index, block id)`` of blocks at or past their request's
        frontier that are still hashed and held by that request alone (never, unless the
        cap was bypassed); a check for tests."""
        found = []
        for req_id, record in self.records.items():
            frontier = record.frontier
            if frontier is None:
                continue
            row = self.group.req_to_blocks.get(req_id, [])
            for index in range(frontier, len(row)):
                block = row[index]
                if not block.is_null and block.ref_cnt == 1 and block.block_hash is not None:
                    found.append((req_id, index, int(block.block_id)))
        return found


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


# ---------------------------------------------------------------------- the manager's hooks
def hook_allocation(
    kv_cache_manager: Any,
    admits: Callable[[Any], bool],
    before_allocate: Callable[[Any], None],
    on_free: Callable[[str], None],
) -> None:
    """Wrap three methods of one ``KVCacheManager`` instance for the release group.

    * ``allocate_slots(request, ...)``: a request ``admits`` refuses gets None (vLLM keeps it
      waiting, as when the pool is full); otherwise ``before_allocate(request)`` runs first,
      so blocks it gives back already count for this step's admissions (as vLLM's own
      ``remove_skipped_blocks`` does at the same point);
    * ``free(request)`` and ``pop_blocks_for_free(request)`` (vLLM 0.32's deferred frees):
      ``on_free(request_id)`` runs before vLLM takes the request's blocks back.

    Raises:
        ValueError: the manager is already hooked, or lacks ``allocate_slots`` / ``free``.
    """
    if getattr(kv_cache_manager, "_lmcompact_hooked", False):
        raise ValueError("this KVCacheManager already has a memory manager bound")
    for name in ("allocate_slots", "free"):
        if not callable(getattr(kv_cache_manager, name, None)):
            raise ValueError(
                f"vLLM's KVCacheManager has no {name}: the release group cannot give blocks "
                'back on this vLLM; remove the "release" group'
            )
    kv_cache_manager._lmcompact_hooked = True
    allocate = kv_cache_manager.allocate_slots
    free = kv_cache_manager.free
    pop = getattr(kv_cache_manager, "pop_blocks_for_free", None)

    @wraps(allocate)
    def allocate_slots(request: Any, *args: Any, **kwargs: Any) -> Any:
        if not admits(request):
            return None
        before_allocate(request)
        return allocate(request, *args, **kwargs)

    @wraps(free)
    def free_request(request: Any) -> None:
        on_free(request.request_id)
        free(request)

    kv_cache_manager.allocate_slots = allocate_slots
    kv_cache_manager.free = free_request
    if pop is not None:

        @wraps(pop)
        def pop_blocks_for_free(request: Any) -> Any:
            on_free(request.request_id)
            return pop(request)

        kv_cache_manager.pop_blocks_for_free = pop_blocks_for_free


_MANAGERS: list[weakref.ref[Any]] = []
"""The ``KVCacheManager`` objects created since :func:`track_kv_cache_managers` (weakly)."""


def track_kv_cache_managers(manager_class: Any = None) -> bool:
    """Record every ``KVCacheManager`` vLLM creates from now on (idempotent, class level).

    vLLM 0.32 hands connectors the manager (``bind_kv_cache_manager``); vLLM 0.26 creates the
    scheduler's connector before its manager and later hands over only
    ``manager.block_pool`` (``bind_gpu_block_pool``, from ``Scheduler.__init__``). The
    scheduler half calls this when it is built, so the manager made right after is
    recorded and :func:`kv_cache_manager_owning` can find it by its pool. Returns False when
    this vLLM has no such class. ``manager_class`` replaces vLLM's class (tests).
    """
    if manager_class is None:
        try:
            from vllm.v1.core.kv_cache_manager import KVCacheManager as manager_class
        except ImportError:
            return False
    if getattr(manager_class, "_lmcompact_tracked", False):
        return True
    init = manager_class.__init__

    def __init__(manager: Any, *args: Any, **kwargs: Any) -> None:
        init(manager, *args, **kwargs)
        _MANAGERS[:] = [ref for ref in _MANAGERS if ref() is not None]
        _MANAGERS.append(weakref.ref(manager))

    manager_class.__init__ = __init__
    manager_class._lmcompact_tracked = True
    return True


def kv_cache_manager_owning(block_pool: Any) -> Any | None:
    """The recorded ``KVCacheManager`` whose ``block_pool`` is ``block_pool`` (the very
    object), or None (see :func:`track_kv_cache_managers`)."""
    for ref in _MANAGERS:
        manager = ref()
        if manager is not None and getattr(manager, "block_pool", None) is block_pool:
            return manager
    return None
