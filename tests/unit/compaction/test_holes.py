"""Virtual block tables that skip a request's hole (``lmcompact.compaction.holes``)."""

from __future__ import annotations

import torch

from lmcompact.compaction.holes import Hole, skip_holes


def test_skip_holes_cuts_blocks_and_shortens_seq_len() -> None:
    table = torch.tensor(
        [[11, 12, 13, 14, 15, 16, 17, 18], [21, 22, 0, 0, 0, 0, 0, 0]], dtype=torch.int32
    )
    lens = torch.tensor([8 * 32 - 5, 40], dtype=torch.int32)
    out = skip_holes(table, lens, 2, {11: Hole(11, 2, 4)}, 32)
    assert out is not None
    new_table, new_lens, rows = out
    assert rows == [0]
    assert new_table[0].tolist() == [11, 12, 17, 18, 0, 0, 0, 0]
    assert new_lens.tolist() == [8 * 32 - 5 - 128, 40]
    assert table[0, 2] == 13  # input untouched
    assert skip_holes(table, lens, 2, {99: Hole(99, 1, 1)}, 32) is None
