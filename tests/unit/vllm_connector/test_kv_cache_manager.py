"""BlockLedger and PrefixCacheGuard against vLLM's real BlockPool: release, sharing, errors,
audit, frontiers kept in the scheduler's request records."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm")

from vllm.v1.core.block_pool import BlockPool

from connectors.vllm.patches.kv_cache_manager import (
    BlockAccountingError,
    BlockLedger,
    PrefixCacheGuard,
    audit_pool,
)
from connectors.vllm.requests import RequestState, RequestStates

NUM_BLOCKS = 32


def make_manager() -> Any:
    """The parts of vLLM's KVCacheManager the ledger and the audit use."""
    pool = BlockPool(num_gpu_blocks=NUM_BLOCKS, enable_caching=False, hash_block_size=16)
    group = SimpleNamespace(req_to_blocks={})
    return SimpleNamespace(
        block_pool=pool, coordinator=SimpleNamespace(single_type_managers=(group,))
    )


def allocate(manager: Any, req_id: str, n: int) -> list[Any]:
    row = manager.block_pool.get_new_blocks(n)
    manager.coordinator.single_type_managers[0].req_to_blocks[req_id] = row
    return row


def vllm_free(manager: Any, req_id: str) -> None:
    """What vLLM does at finish, abort and preemption."""
    row = manager.coordinator.single_type_managers[0].req_to_blocks.pop(req_id)
    manager.block_pool.free_blocks(reversed(row))


def test_release_middle_then_finish_balances_pool() -> None:
    manager = make_manager()
    ledger = BlockLedger(manager)
    start = ledger.num_free()
    row = allocate(manager, "a", 8)
    ids = [b.block_id for b in row]
    released = ledger.release("a", 2, 6)
    assert sorted(released.freed) == sorted(ids[2:6]) and released.kept == ()
    assert ledger.num_free() == start - 4
    assert ledger.held("a") == 4
    assert ledger.block_ids("a") == ids[:2] + [0] * 4 + ids[6:]
    assert audit_pool(manager).ok
    assert ledger.release("a", 2, 6).freed == ()  # idempotent: null entries are skipped
    assert ledger.release("a", 2, 7).freed == (ids[6],)  # a grown hole frees only the new block
    vllm_free(manager, "a")
    assert ledger.num_free() == start
    assert audit_pool(manager).ok and audit_pool(manager).referenced == 0


def test_freed_blocks_are_reused_without_aliasing() -> None:
    manager = make_manager()
    ledger = BlockLedger(manager)
    allocate(manager, "a", 10)
    ledger.release("a", 1, 9)
    other = allocate(manager, "b", 8)
    assert not set(b.block_id for b in other) & set(ledger.block_ids("a"))
    audit = audit_pool(manager)
    assert audit.ok and audit.referenced == 10
    vllm_free(manager, "b")
    vllm_free(manager, "a")
    assert ledger.num_free() == NUM_BLOCKS - 1


def test_shared_blocks_stay_and_hashed_owned_blocks_go_back_cached() -> None:
    manager = make_manager()
    ledger = BlockLedger(manager)
    row = allocate(manager, "a", 6)
    ids = [b.block_id for b in row]
    manager.block_pool.touch([row[2]])  # another holder: ref_cnt 2
    row[3]._block_hash = b"cached"  # an exact block still hashed (before the frontier)
    released = ledger.release("a", 1, 5)
    assert released.kept == (ids[2],)
    assert sorted(released.freed) == sorted([ids[1], ids[3], ids[4]])
    assert ledger.block_ids("a") == [ids[0], 0, ids[2], 0, 0, ids[5]]
    assert ledger.blocks("a")[2].ref_cnt == 2
    assert manager.block_pool.blocks[ids[3]].block_hash == b"cached"  # a cached free block


def test_errors_raise() -> None:
    manager = make_manager()
    ledger = BlockLedger(manager)
    with pytest.raises(BlockAccountingError, match="unknown request"):
        ledger.release("nobody", 0, 1)
    row = allocate(manager, "a", 4)
    with pytest.raises(BlockAccountingError, match="outside"):
        ledger.release("a", 2, 5)
    row[1].ref_cnt = 0
    with pytest.raises(BlockAccountingError, match="ref_cnt 0"):
        ledger.release("a", 1, 2)


def test_audit_finds_free_and_referenced() -> None:
    manager = make_manager()
    row = allocate(manager, "a", 3)
    manager.block_pool.free_blocks([row[1]])  # freed behind the request's back
    audit = audit_pool(manager)
    assert not audit.ok
    assert audit.free_and_referenced == (row[1].block_id,)
    assert audit.ref_mismatch == ((row[1].block_id, 0, 1),)


def test_more_than_one_group_is_refused() -> None:
    manager = make_manager()
    group = manager.coordinator.single_type_managers[0]
    manager.coordinator.single_type_managers = (group, group)
    with pytest.raises(ValueError, match="one KV-cache group"):
        BlockLedger(manager)


# ---------------------------------------------------------------------- PrefixCacheGuard
BS = 16


def make_cached_manager() -> tuple[Any, dict[str, int]]:
    """A real caching BlockPool behind a coordinator that hashes like vLLM's: each call
    hashes the request's full blocks from where the last call stopped."""
    pool = BlockPool(num_gpu_blocks=NUM_BLOCKS, enable_caching=True, hash_block_size=BS)
    group = SimpleNamespace(req_to_blocks={}, block_size=BS)
    num_cached: dict[str, int] = {}

    def cache_blocks(request: Any, num_tokens: int) -> None:
        row = group.req_to_blocks[request.request_id]
        done, full = num_cached.get(request.request_id, 0), num_tokens // BS
        pool.cache_full_blocks(request, row, done, full, BS, 0)
        num_cached[request.request_id] = max(done, full)

    def pop_blocks_for_free(request_id: str) -> list[Any]:
        num_cached.pop(request_id, None)
        return group.req_to_blocks.pop(request_id, [])

    def free(request_id: str) -> None:
        pool.free_blocks(reversed(pop_blocks_for_free(request_id)))

    coordinator = SimpleNamespace(
        single_type_managers=(group,),
        cache_blocks=cache_blocks,
        free=free,
        pop_blocks_for_free=pop_blocks_for_free,
    )
    return SimpleNamespace(block_pool=pool, coordinator=coordinator), num_cached


def request(req_id: str, num_blocks: int) -> Any:
    hashes = [bytes([i + 1]) * 32 for i in range(num_blocks)]  # a chain, as vLLM's ids
    return SimpleNamespace(request_id=req_id, block_hashes=hashes, mm_features=[])


def records(*req_ids: str) -> RequestStates:
    """The scheduler's request records (a frontier lives in its request's record)."""
    states = RequestStates()
    for req_id in req_ids:
        states.add(req_id, RequestState(prompt=[], keys=[]))
    return states


def cached(manager: Any, req: Any, index: int) -> bool:
    return manager.block_pool.get_cached_block(req.block_hashes[index], [0]) is not None


def test_guard_unhashes_from_the_frontier_and_caps_later_hashing() -> None:
    manager, _ = make_cached_manager()
    states = records("a")
    guard = PrefixCacheGuard(manager, states)
    req = request("a", 8)
    row = allocate(manager, "a", 6)
    manager.coordinator.cache_blocks(req, 6 * BS)
    assert all(cached(manager, req, i) for i in range(6))
    manager.block_pool.touch(row[:2])  # another request hit the first two blocks
    assert guard.freeze("a", 2) == 2
    assert states["a"].frontier == 2  # kept in the request's record
    assert [cached(manager, req, i) for i in range(6)] == [True] * 2 + [False] * 4
    assert guard.unhashed == 4 and guard.violations() == []
    row.extend(manager.block_pool.get_new_blocks(2))  # the request grows
    manager.coordinator.cache_blocks(req, 8 * BS)
    assert not cached(manager, req, 6) and not cached(manager, req, 7)
    assert guard.freeze("a", 5) == 2  # the smallest frontier stays
    row[4]._block_hash = b"bypass"  # a hash the cap did not stop: reported
    assert guard.violations() == [("a", 4, row[4].block_id)]
    row[4].reset_hash()
    manager.coordinator.free("a")  # finish: the frontier goes with the request
    assert guard.frontier("a") is None and states["a"].frontier is None
    row = allocate(manager, "a", 3)  # recomputed after a preemption: hashed again
    manager.coordinator.cache_blocks(req, 3 * BS)
    assert cached(manager, req, 2)


def test_guard_keeps_shared_blocks_hashed_and_binds_once() -> None:
    manager, _ = make_cached_manager()
    states = records("a")
    guard = PrefixCacheGuard(manager, states)
    req = request("a", 4)
    row = allocate(manager, "a", 4)
    manager.coordinator.cache_blocks(req, 4 * BS)
    manager.block_pool.touch([row[3]])  # held by someone else too
    guard.freeze("a", 1)
    assert [cached(manager, req, i) for i in range(4)] == [True, False, False, True]
    with pytest.raises(ValueError, match="already has a prefix-cache guard"):
        PrefixCacheGuard(manager, states)
    with pytest.raises(ValueError, match="freeze"):
        guard.freeze("a", -1)
    with pytest.raises(RuntimeError, match="no record"):  # frontiers live in the records
        guard.freeze("b", 0)
    bare = make_manager()
    with pytest.raises(ValueError, match="cache_blocks"):
        PrefixCacheGuard(bare, states)
