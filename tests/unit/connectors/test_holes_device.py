"""skip_holes_on_device (no host round trip) equals skip_holes on the rows in use."""

from __future__ import annotations

import torch

from connectors.holes import Hole, cut_holes_in_place, skip_holes, skip_holes_on_device

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
