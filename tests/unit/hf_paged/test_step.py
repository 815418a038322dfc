"""A decode step for all layers at once (``append_token``, ``DecodeState``) vs per-layer."""

from __future__ import annotations

import torch

from lmcompact.hf.paged import BlockPool, BlockTable, KVStorage, StorageSpec
from lmcompact.hf.paged.step import DecodeState, append_token

LAYERS, ROWS, HEADS, DIM, BS, PROMPT = 3, 4, 2, 4, 4, 6


def _setup() -> tuple[BlockPool, KVStorage, list[BlockTable]]:
    """LAYERS tables whose ROWS share one PROMPT-token prefill (as beams do)."""
    pool = BlockPool(200)
    storage = KVStorage(StorageSpec(200, BS, HEADS, DIM, torch.float32), "cpu")
    tables = []
    for layer in range(LAYERS):
        ids = pool.allocate(-(-PROMPT // BS))
        pool.incref(ids.repeat(ROWS - 1))
        table = BlockTable.empty(ROWS, HEADS, BS)
        table.blocks, table.num_slots = ids.expand(ROWS, -1).clone(), PROMPT
        slots = torch.arange(PROMPT)
        values = torch.full((HEADS, PROMPT, DIM), float(layer)) + slots[None, :, None]
        storage.write(ids[slots // BS], slots % BS, values, -values)
        tables.append(table)
    return pool, storage, tables


def _rows(storage: KVStorage, table: BlockTable) -> torch.Tensor:
    """``(B, Hkv, num_slots, D)`` keys read through the table."""
    slots = torch.arange(table.num_slots)
    return torch.stack([storage.read_slots(*table.addresses(b, slots))[0] for b in range(ROWS)])


def _recount(pool: BlockPool, tables: list[BlockTable]) -> torch.Tensor:
    counts = torch.zeros(pool.num_blocks, dtype=torch.int64)
    for table in tables:
        counts.index_add_(
            0, table.blocks.reshape(-1), torch.ones(table.blocks.numel(), dtype=torch.int64)
        )
    return counts


def test_append_token_matches_per_table_append_across_beam_reorders() -> None:
    batched, single = _setup(), _setup()
    gen = torch.Generator().manual_seed(0)
    for step in range(11):  # crosses block boundaries twice; duplicated parents force COW
        rows = torch.randint(0, ROWS, (ROWS,), generator=gen)
        for pool, _, tables in (batched, single):
            BlockTable.reorder_all(tables, rows, pool)
        append_token(batched[2], batched[0], batched[1])
        for table in single[2]:
            table.append(1, single[0], single[1])
        for pool, storage, tables in (batched, single):
            for layer, table in enumerate(tables):
                slot = table.num_slots - 1
                token = torch.arange(ROWS, dtype=torch.float32)[None, :, None] * 100 + step
                values = token.expand(HEADS, ROWS, DIM) + layer
                storage.write(
                    table.blocks[:, slot // BS], torch.full((ROWS,), slot % BS), values, values
                )
            pool.check_counts(_recount(pool, tables))
        assert batched[0].num_used == single[0].num_used
        for a, b in zip(batched[2], single[2], strict=True):
            assert a.num_slots == b.num_slots == PROMPT + step + 1
            assert torch.equal(_rows(batched[1], a), _rows(single[1], b))


def test_decode_state_holds_every_layers_tables_and_lengths() -> None:
    pool, storage, tables = _setup()
    tables[1].kept = torch.tensor([[3, 1], [0, 2], [4, 4], [1, 1]])
    tables[1].tail_start = 4  # as after a compaction of layer 1 only
    append_token(tables, pool, storage)
    state = DecodeState.build(LAYERS, ROWS, HEADS, 5, torch.device("cpu"), num_splits=2)
    state.fill(tables)
    assert state.cu_seqlens_q.tolist() == list(range(ROWS + 1))
    for layer, table in enumerate(tables):
        width = table.blocks.shape[1]
        assert torch.equal(state.tables[layer, :, :width], table.blocks)
        slot = table.num_slots - 1
        assert torch.equal(state.write_block[layer], table.blocks[:, slot // BS])
        assert state.write_offset[layer].tolist() == [slot % BS] * ROWS
        lengths = state.lengths(layer)
        assert torch.equal(lengths.kept, table.kept)
        assert lengths.tail_start.tolist() == [table.tail_start] * ROWS
        assert lengths.seq_len.tolist() == [table.num_slots] * ROWS
    assert state.fits(LAYERS, ROWS, HEADS, 5, torch.device("cpu"))
    assert not state.fits(LAYERS, ROWS, HEADS, 6, torch.device("cpu"))
    assert not state.fits(LAYERS, ROWS + 1, HEADS, 5, torch.device("cpu"))
