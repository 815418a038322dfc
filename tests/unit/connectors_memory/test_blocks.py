"""BlockLedger against vLLM's real BlockPool: release, sharing, errors, audit."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm")

from vllm.v1.core.block_pool import BlockPool

from connectors.memory.blocks import BlockAccountingError, BlockLedger, audit_pool

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


def test_shared_and_cached_blocks_stay() -> None:
    manager = make_manager()
    ledger = BlockLedger(manager)
    row = allocate(manager, "a", 6)
    ids = [b.block_id for b in row]
    manager.block_pool.touch([row[2]])  # another holder: ref_cnt 2
    row[3]._block_hash = b"cached"  # a prefix-cache hash
    released = ledger.release("a", 1, 5)
    assert released.kept == (ids[2], ids[3])
    assert sorted(released.freed) == sorted([ids[1], ids[4]])
    assert ledger.block_ids("a") == [ids[0], 0, ids[2], ids[3], 0, ids[5]]
    assert ledger.blocks("a")[2].ref_cnt == 2


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
