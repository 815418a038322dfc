"""Per-head kept counts: padded pack plus masked reference attention equal attention over
exactly each head's kept tokens and the tail."""

from __future__ import annotations

import math

import pytest
import torch

from lmcompact.compaction.page_layout import make_layout
from lmcompact.compaction.per_head import masked_decode_attention, pack_per_head

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
def test_padded_pack_and_masked_attention_match_direct(layout_name: str) -> None:
    layout = make_layout(layout_name, BS)
    gen = torch.Generator().manual_seed(0)
    kv = torch.randn(16, H, BS, 2 * D, generator=gen)
    row = [3, 9, 1, 14, 6, 2, 11, 5]  # 6 blocks compacted (48 tokens), tail in blocks 6..7
    keys, values = layout.read(kv, row, 0, 8 * BS)
    kept = [[torch.tensor([0, 1, 7, 20, 33]), torch.arange(0, 48, 3)]]  # 5 and 16 tokens
    counts, k_max = pack_per_head([kv], layout, row, 6 * BS, kept)
    assert counts.tolist() == [[5, 16]] and k_max == 16
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
        pack_per_head([kv], layout, row, 2 * BS, [[torch.arange(9), torch.arange(3)]])
    with pytest.raises(ValueError, match=">= 1 kept"):
        pack_per_head([kv], layout, row, 4 * BS, [[torch.arange(0), torch.arange(3)]])
    with pytest.raises(ValueError, match="leave"):
        pack_per_head([kv], layout, row, 4 * BS, [[torch.tensor([40]), torch.arange(3)]])
