"""skip_holes_on_device (no host round trip) equals skip_holes on the rows in use; rows are
found by their key column (block 0, or the last block when block 0 may be shared)."""

from __future__ import annotations

import pytest
import torch

from lmcompact.compaction.holes import (
    Hole,
    cut_holes_in_place,
    keyed_by_last_block,
    skip_holes,
    skip_holes_on_device,
)

BS = 4


def test_device_cut_equals_host_cut() -> None:
    table = torch.zeros(5, 10, dtype=torch.int32)
    rows = {0: [7, 8, 9, 10, 11, 12, 13], 1: [3, 4, 5], 2: [20, 21, 22, 23, 24, 25, 26, 27, 28, 29]}
    for r, ids in rows.items():
        table[r, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
    table[3, :3] = torch.tensor([20, 1, 2], dtype=torch.int32)  # padding row, stale first block
    lens = torch.tensor([7 * BS - 1, 3 * BS, 10 * BS - 2, 3 * BS, 0], dtype=torch.int32)
    holes = {7: Hole(7, 1, 3), 20: Hole(20, 2, 5), 99: Hole(99, 1, 1)}
    want = skip_holes(table, lens, 3, holes, BS)
    got = skip_holes_on_device(table, lens, 3, holes, BS)
    assert want is not None and got is not None
    assert torch.equal(got[0][:3], want[0][:3])
    assert torch.equal(got[1][:3], want[1][:3])
    assert torch.equal(got[0][3:], table[3:])  # rows past num_reqs are left alone
    assert got[0].dtype == table.dtype and got[1].dtype == lens.dtype


def test_no_holes_no_edit() -> None:
    table = torch.ones(2, 3, dtype=torch.int32)
    assert skip_holes_on_device(table, torch.ones(2, dtype=torch.int32), 2, {}, BS) is None


def test_in_place_cut_by_rows_equals_host_cut() -> None:
    table = torch.zeros(4, 10, dtype=torch.int32)
    rows = {0: [7, 8, 9, 10, 11, 12, 13], 1: [3, 4, 5], 2: [20, 21, 22, 23, 24, 25, 26, 27, 28, 29]}
    for r, ids in rows.items():
        table[r, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
    lens = torch.tensor([7 * BS - 1, 3 * BS, 10 * BS - 2, 0], dtype=torch.int32)
    holes = {7: Hole(7, 1, 3, req_id="a"), 20: Hole(20, 2, 5, req_id="c")}
    want = skip_holes(table, lens, 3, holes, BS)
    assert want is not None
    cut_table, cut_lens = table.clone(), lens.clone()
    cut_holes_in_place(cut_table, cut_lens, [0, 2], [1, 2], [3, 5], BS)
    assert torch.equal(cut_table, want[0])
    assert torch.equal(cut_lens, want[1])
    assert torch.equal(cut_table[1], table[1]) and int(cut_lens[1]) == 3 * BS  # no hole: unchanged
    untouched = table.clone()
    cut_holes_in_place(untouched, lens.clone(), [], [], [], BS)
    assert torch.equal(untouched, table)


def test_rows_sharing_block_zero_are_told_apart_by_their_last_block() -> None:
    """Prefix caching: rows 0 and 1 share blocks 7, 8 (a cache hit); row 0's hole is keyed
    by its last block. Row 2 lists block 30 stale inside its own (released) hole, at the
    very column row 0's key sits in: it must not take row 0's hole."""
    table = torch.zeros(4, 8, dtype=torch.int32)
    table[0, :5] = torch.tensor([7, 8, 9, 10, 30], dtype=torch.int32)
    table[1, :3] = torch.tensor([7, 8, 11], dtype=torch.int32)
    table[2, :7] = torch.tensor([40, 41, 42, 43, 30, 44, 45], dtype=torch.int32)
    lens = torch.tensor([5 * BS - 1, 3 * BS, 7 * BS - 2, 0], dtype=torch.int32)
    keyed = keyed_by_last_block(Hole(7, 2, 2), [7, 8, 9, 10, 30], 5 * BS - 1, BS)
    assert (keyed.first_block, keyed.key_column) == (30, 4)
    holes = {keyed.first_block: keyed, 40: Hole(40, 1, 2)}
    want = skip_holes(table, lens, 3, holes, BS)
    got = skip_holes_on_device(table, lens, 3, holes, BS)
    assert want is not None and got is not None
    assert want[2] == [0, 2]  # row 1 (same block 0, no hole) is left alone
    assert want[0][0].tolist() == [7, 8, 30, 0, 0, 0, 0, 0]
    assert want[0][1].tolist() == table[1].tolist()
    assert want[0][2].tolist() == [40, 43, 30, 44, 45, 0, 0, 0]
    assert want[1].tolist() == [3 * BS - 1, 3 * BS, 5 * BS - 2, 0]
    assert torch.equal(got[0][:3], want[0][:3]) and torch.equal(got[1][:3], want[1][:3])
    with pytest.raises(ValueError, match="key column"):
        Hole(30, 2, 3, key_column=3)  # a key inside the hole would be released
