"""Attention over block tables: shared-block path vs gathered path vs the kernels' reference."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lmcompact.hf.paged import BlockPool, BlockTable, KVStorage, StorageSpec
from lmcompact.hf.paged.attention import gathered_attention, shared_block_attention
from lmcompact.hf.paged.quant import dequantize_int8, quantize_int8
from lmcompact.hf.paged.table import allocate_cleared
from lmcompact.kernels.reference_paged import paged_attention_reference


def _filled(
    rows: int, heads: int, dim: int, bs: int, prompt: int, tail: int, kv_dtype: str, seed: int
) -> tuple[KVStorage, BlockTable, BlockPool]:
    """A prompt shared by every row, then ``tail`` steps with random beam reorders."""
    g = torch.Generator().manual_seed(seed)
    pool = BlockPool(200)
    storage = KVStorage(StorageSpec(200, bs, heads, dim, torch.float32, kv_dtype), "cpu")
    if kv_dtype == "auto":  # what torch.empty may hold: attention must never read it
        storage.keys.fill_(float("nan"))
        storage.values.fill_(float("nan"))
    table = BlockTable.empty(rows, heads, bs)
    ids = allocate_cleared(pool, storage, -(-prompt // bs))
    pool.incref(ids.repeat(rows - 1))
    table.blocks, table.num_slots = ids.expand(rows, -1).clone(), prompt
    slots = torch.arange(prompt)
    kv = torch.randn(2, heads, prompt, dim, generator=g)
    storage.write(ids[slots // bs], slots % bs, kv[0], kv[1])
    for _ in range(tail):
        table.reorder(torch.randint(0, rows, (rows,), generator=g), pool)
        new = table.append(1, pool, storage)
        blocks = table.blocks.gather(1, new // bs).reshape(-1)
        kv = torch.randn(2, heads, rows, dim, generator=g)
        storage.write(blocks, (new % bs).reshape(-1), kv[0], kv[1])
    return storage, table, pool


@settings(max_examples=30, deadline=None)
@given(
    rows=st.integers(1, 4),
    heads=st.integers(1, 3),
    group=st.sampled_from([1, 3]),
    bs=st.sampled_from([1, 2, 4, 8]),
    prompt=st.integers(1, 40),
    tail=st.integers(0, 12),
    seed=st.integers(0, 2**16),
)
def test_shared_block_path_matches_gathered_and_kernel_reference(
    rows: int, heads: int, group: int, bs: int, prompt: int, tail: int, seed: int
) -> None:
    dim = 8
    storage, table, _ = _filled(rows, heads, dim, bs, prompt, tail, "auto", seed)
    query = torch.randn(rows, heads * group, 1, dim, generator=torch.Generator().manual_seed(seed))
    fast = shared_block_attention(query, storage, table, 0.3)
    slow = gathered_attention(query, storage, table, 0.3)
    torch.testing.assert_close(fast, slow, atol=1e-5, rtol=1e-5)
    key_pool, value_pool = storage.paged_views()
    ref, _ = paged_attention_reference(
        query.transpose(1, 2).reshape(rows, heads * group, dim),
        key_pool,
        value_pool,
        table.blocks,
        torch.arange(rows + 1),
        table.lengths(),
        scale=0.3,
    )
    torch.testing.assert_close(fast.reshape(rows, heads * group, dim), ref, atol=1e-5, rtol=1e-5)


def test_compacted_rows_see_kept_slots_and_tail_only() -> None:
    """kept / hole / tail: with kept < tail_start, hole slots must not count."""
    storage, table, _ = _filled(2, 2, 8, 4, prompt=12, tail=3, kv_dtype="auto", seed=1)
    table.kept = torch.tensor([[2, 4], [1, 3]])
    table.tail_start = 8
    query = torch.randn(2, 2, 1, 8)
    fast = shared_block_attention(query, storage, table, 0.5)
    # by hand: row 0 head 0 sees slots 0, 1 and 8..num_slots-1
    slots = torch.cat([torch.arange(2), torch.arange(8, table.num_slots)])
    keys, values = storage.read_slots(*table.addresses(0, slots))
    probs = torch.softmax(query[0, 0, 0] @ keys[0].T * 0.5, dim=-1)
    torch.testing.assert_close(fast[0, 0, 0], probs @ values[0])
    torch.testing.assert_close(fast, gathered_attention(query, storage, table, 0.5))


def test_int8_storage_attention_error_is_bounded() -> None:
    exact, table, _ = _filled(3, 2, 64, 16, prompt=100, tail=10, kv_dtype="auto", seed=3)
    quant, table_q, _ = _filled(3, 2, 64, 16, prompt=100, tail=10, kv_dtype="int8", seed=3)
    assert torch.equal(table.blocks, table_q.blocks)
    query = torch.randn(3, 6, 1, 64)
    out = shared_block_attention(query, exact, table, 64**-0.5)
    out_q = shared_block_attention(query, quant, table_q, 64**-0.5)
    assert (out - out_q).abs().max() < 0.02
    torch.testing.assert_close(out_q, gathered_attention(query, quant, table_q, 64**-0.5))


@settings(max_examples=50, deadline=None)
@given(seed=st.integers(0, 2**16), scale=st.floats(1e-3, 1e3))
def test_int8_roundtrip_error_at_most_half_a_step(seed: int, scale: float) -> None:
    x = torch.randn(5, 7, 64, generator=torch.Generator().manual_seed(seed)) * scale
    q, s = quantize_int8(x)
    assert q.dtype == torch.int8 and s.shape == (5, 7)
    err = (dequantize_int8(q, s, torch.float32) - x).abs()
    assert bool((err <= s.unsqueeze(-1) * 0.5 * (1 + 1e-5)).all())


def test_storage_rejects_bad_specs() -> None:
    with pytest.raises(ValueError, match="kv_dtype must be one of"):
        StorageSpec(4, 4, 1, 8, torch.float32, "int4")
    with pytest.raises(ValueError, match="block_size must be > 0"):
        StorageSpec(4, 0, 1, 8, torch.float32)
    assert StorageSpec(1, 64, 3, 64, torch.float32, "int8").bytes_per_block == 2 * (
        64 * 3 * 64 + 64 * 3 * 4
    )
