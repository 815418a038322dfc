"""Per-head kept counts: the dense cell pack plus the masked reference attention equal
attention over exactly each head's kept tokens and the tail; cells take the sum of the
counts, not the largest."""

from __future__ import annotations

import math

import pytest
import torch

from lmcompact.compaction.page_layout import make_layout
from lmcompact.compaction.per_head import (
    dense_image,
    dense_rows,
    masked_decode_attention,
    pack_per_head,
)

BS, H, G, D = 8, 2, 2, 4


def direct_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    kept: list[torch.Tensor],
    tail: range,
    scale: float,
) -> torch.Tensor:
    """Queries ``(S, H*G, D)`` at the last ``S`` tail positions, head by head."""
    s = q.shape[0]
    out = torch.zeros_like(q)
    for h in range(H):
        for i in range(s):
            visible_tail = list(tail)[: len(tail) - s + i + 1]
            index = torch.cat([kept[h], torch.tensor(visible_tail, dtype=torch.int64)])
            k, v = keys[h, index], values[h, index]
            for g in range(G):
                w = torch.softmax(q[i, h * G + g] @ k.T * scale, dim=-1)
                out[i, h * G + g] = w @ v
    return out


@pytest.mark.parametrize("layout_name", ["head_major_kt", "token_major"])
def test_dense_pack_and_masked_attention_match_direct(layout_name: str) -> None:
    layout = make_layout(layout_name, BS)
    gen = torch.Generator().manual_seed(0)
    kv = torch.randn(16, H, BS, 2 * D, generator=gen)
    row = [3, 9, 1, 14, 6, 2, 11, 5]  # 6 blocks compacted (48 tokens), tail in blocks 6..7
    keys, values = layout.read(kv, row, 0, 8 * BS)
    kept = [[torch.tensor([0, 1, 7, 20, 33]), torch.arange(2, 42)]]  # 5 and 40 tokens
    counts, k_max = pack_per_head([kv], layout, row, 6 * BS, kept)
    # 45 cells in blocks of 8 slots x 2 heads: 3 blocks, where padding to 40 would take 5
    assert counts.tolist() == [[5, 40]] and k_max == 3 * BS
    seq_len, q_len = 8 * BS - 3, 3
    queries = torch.randn(q_len, H * G, D, generator=gen)
    scale = 1 / math.sqrt(D)
    got = masked_decode_attention(queries, kv, layout, row, counts[0], 6 * BS, seq_len, scale)
    want = direct_attention(queries, keys, values, kept[0], range(6 * BS, seq_len), scale)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_bad_per_head_packs_raise() -> None:
    layout = make_layout("head_major_kt", BS)
    kv = torch.zeros(8, H, BS, 2 * D)
    row = [0, 1, 2, 3]
    with pytest.raises(ValueError, match="leaves no hole"):
        pack_per_head([kv], layout, row, 2 * BS, [[torch.arange(16), torch.arange(3)]])
    with pytest.raises(ValueError, match="hold the largest layer"):
        pack_per_head([kv], layout, row, 4 * BS, [[torch.arange(9), torch.arange(9)]], BS)
    with pytest.raises(ValueError, match=">= 1 kept"):
        pack_per_head([kv], layout, row, 4 * BS, [[torch.arange(0), torch.arange(3)]])
    with pytest.raises(ValueError, match="leave"):
        pack_per_head([kv], layout, row, 4 * BS, [[torch.tensor([40]), torch.arange(3)]])


def test_dense_image_lays_heads_out_cell_after_cell() -> None:
    rows = torch.arange(2 * 6, dtype=torch.float32).view(2, 6, 1)  # head h, row i: 6h + i
    image = dense_image(rows, torch.tensor([3, 6]), 2 * 4, 4)  # bs 4, 2 heads: 8 cells a block
    cells = [  # block 0: head 0's slots hold cells 0-3, head 1's cells 4-7; block 1: 8-15
        image[0, 0:4],
        image[1, 0:4],
        image[0, 4:8],
        image[1, 4:8],
    ]
    flat = torch.cat(cells).flatten().tolist()
    assert flat == [0, 1, 2, 6, 7, 8, 9, 10, 11, 0, 0, 0, 0, 0, 0, 0]
    with pytest.raises(ValueError, match="do not fit"):
        dense_image(rows, torch.tensor([6, 6]), 4, 4)


def test_dense_rows_reads_back_what_dense_image_laid_out() -> None:
    torch.manual_seed(0)
    rows = torch.randn(4, 40, 3)
    counts = torch.tensor([40, 1, 17, 30])
    image = dense_image(rows, counts, 24, 8)  # 96 cells, 88 used
    back = dense_rows(image, counts, 8)
    assert [r.shape[0] for r in back] == counts.tolist()
    for head, got in enumerate(back):
        assert torch.equal(got, rows[head, : int(counts[head])])
