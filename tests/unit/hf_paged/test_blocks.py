"""BlockPool reference counts and BlockTable copy-on-write / reorder accounting."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lmcompact.hf.paged import BlockPool, BlockPoolExhausted, BlockTable, KVStorage, StorageSpec


def _storage(num_blocks: int, block_size: int, heads: int = 2, dim: int = 4) -> KVStorage:
    return KVStorage(StorageSpec(num_blocks, block_size, heads, dim, torch.float32), "cpu")


def _recount(pool: BlockPool, *tables: BlockTable) -> torch.Tensor:
    counts = torch.zeros(pool.num_blocks, dtype=torch.int64)
    for table in tables:
        ids = table.blocks.reshape(-1)
        counts.index_add_(0, ids, torch.ones_like(ids))
    return counts


def test_allocate_ascending_and_free_reused_first() -> None:
    pool = BlockPool(6)
    assert pool.allocate(3).tolist() == [0, 1, 2]
    pool.decref(torch.tensor([1]))
    assert pool.allocate(1).tolist() == [1]
    assert pool.num_used == 3 and pool.peak_used == 3


def test_errors_raise_never_clamp() -> None:
    pool = BlockPool(2)
    ids = pool.allocate(2)
    with pytest.raises(BlockPoolExhausted, match="only 0 of 2"):
        pool.allocate(1)
    pool.decref(ids)
    with pytest.raises(RuntimeError, match="below zero"):
        pool.decref(ids[:1])
    with pytest.raises(RuntimeError, match="never allocated"):
        pool.incref(ids[:1])
    with pytest.raises(ValueError, match=r"\[0, 2\)"):
        pool.decref(torch.tensor([5]))
    with pytest.raises(ValueError, match="num_blocks must be > 0"):
        BlockPool(0)
    assert pool.is_pristine()


def test_check_counts_detects_a_missing_reference() -> None:
    pool = BlockPool(4)
    ids = pool.allocate(2)
    pool.incref(ids[:1])
    expected = torch.tensor([2, 1, 0, 0])
    pool.check_counts(expected)
    with pytest.raises(RuntimeError, match="disagree"):
        pool.check_counts(torch.tensor([1, 1, 0, 0]))


def test_reorder_shares_blocks_and_cow_copies_only_the_partial_block() -> None:
    bs = 4
    pool, storage = BlockPool(32), _storage(32, bs)
    table = BlockTable.empty(4, 2, bs)
    # a shared prompt of 6 slots: blocks [0, 1] held by all 4 rows
    ids = pool.allocate(2)
    pool.incref(ids.repeat(3))
    table.blocks, table.num_slots = ids.expand(4, -1).clone(), 6
    storage.keys[:, ids] = torch.randn(2, 2, bs, 4)
    pool.check_counts(_recount(pool, table))
    assert pool.refcount[:2].tolist() == [4, 4]

    used_before = pool.num_used
    table.append(1, pool, storage)  # rows 0-2 copy block 1, row 3 writes in place
    assert pool.num_used == used_before + 3
    assert table.blocks[:, 0].tolist() == [0, 0, 0, 0]
    assert len(set(table.blocks[:, 1].tolist())) == 4
    for row in range(3):
        copied = storage.keys[:, int(table.blocks[row, 1]), :2]
        assert torch.equal(copied, storage.keys[:, 1, :2])
    pool.check_counts(_recount(pool, table))

    table.reorder(torch.tensor([0, 0, 2, 1]), pool)
    pool.check_counts(_recount(pool, table))
    assert int(pool.refcount[int(table.blocks[0, 1])]) == 2
    assert int(pool.refcount[0]) == 4
    table.append(1, pool, storage)  # rows 0 and 1 share their last block: one copy
    pool.check_counts(_recount(pool, table))
    assert len(set(table.blocks[:, 1].tolist())) == 4

    table.release(pool)
    assert pool.is_pristine()


def test_select_and_truncate_keep_counts_exact() -> None:
    bs = 2
    pool, storage = BlockPool(40), _storage(40, bs)
    table = BlockTable.empty(2, 2, bs)
    table.append(5, pool, storage)
    table.select(torch.tensor([0, 0, 1, 1, 1]), pool)
    pool.check_counts(_recount(pool, table))
    table.truncate(3, pool)
    assert table.blocks.shape == (5, 2)
    pool.check_counts(_recount(pool, table))
    with pytest.raises(ValueError, match="uncompacted tail"):
        table.truncate(4, pool)
    table.release(pool)
    assert pool.is_pristine()


@settings(max_examples=40, deadline=None)
@given(
    ops=st.lists(
        st.one_of(
            st.tuples(st.just("append"), st.integers(1, 5)),
            st.tuples(st.just("reorder"), st.lists(st.integers(0, 3), min_size=4, max_size=4)),
        ),
        max_size=25,
    ),
    block_size=st.sampled_from([1, 2, 3, 4]),
)
def test_random_beam_steps_keep_exact_counts(
    ops: list[tuple[str, object]], block_size: int
) -> None:
    pool, storage = BlockPool(400), _storage(400, block_size)
    table = BlockTable.empty(4, 2, block_size)
    shadow = [torch.empty(2, 0, 4) for _ in range(4)]  # what each row must read back
    for op, arg in ops:
        if op == "append":
            assert isinstance(arg, int)
            slots = table.append(arg, pool, storage)
            new = torch.randn(2, 4 * arg, 4)
            blocks = table.blocks.gather(1, slots // block_size).reshape(-1)
            storage.write(blocks, (slots % block_size).reshape(-1), new, new)
            for row in range(4):
                shadow[row] = torch.cat([shadow[row], new[:, row * arg : (row + 1) * arg]], 1)
        else:
            assert isinstance(arg, list)
            table.reorder(torch.tensor(arg), pool)
            shadow = [shadow[i] for i in arg]
        pool.check_counts(_recount(pool, table))
        # the kernels' copy of the table (here on CPU) follows every change
        assert torch.equal(table.device_blocks(torch.device("cpu")), table.blocks.int())
    for row in range(4):
        keys, _ = storage.read_slots(*table.addresses(row, torch.arange(table.num_slots)))
        assert torch.equal(keys, shadow[row])
    table.release(pool)
    assert pool.is_pristine()


def test_reorder_all_equals_one_reorder_per_table() -> None:
    bs = 2
    pools = [BlockPool(64), BlockPool(64)]
    storages = [_storage(64, bs), _storage(64, bs)]
    layouts = []
    for pool, storage in zip(pools, storages, strict=True):
        tables = [BlockTable.empty(4, 2, bs) for _ in range(3)]
        for table in tables:
            table.append(5, pool, storage)
        layouts.append(tables)
    for rows in ([0, 0, 2, 1], [3, 3, 3, 0], [0, 1, 2, 3]):
        BlockTable.reorder_all(layouts[0], torch.tensor(rows), pools[0])
        for table in layouts[1]:
            table.reorder(torch.tensor(rows), pools[1])
        for a, b in zip(*layouts, strict=True):
            assert torch.equal(a.blocks, b.blocks) and torch.equal(a.kept, b.kept)
        assert torch.equal(pools[0].refcount, pools[1].refcount)
        pools[0].check_counts(_recount(pools[0], *layouts[0]))
    with pytest.raises(ValueError, match="beam indices"):
        BlockTable.reorder_all(layouts[0], torch.tensor([0, 1]), pools[0])
    for table in layouts[0]:
        table.release(pools[0])
    assert pools[0].is_pristine()
