"""PerHeadAttention: the after-attention recompute overwrites exactly the per-head rows.

The metadata here is a stand-in with the three fields the recompute reads (the real
engine's is exercised in tests/integration/vllm_release/test_per_head.py). The expected
rows come from :func:`lmcompact.compaction.per_head.masked_decode_attention` on the
*physical* block row with the hole, not the hole-skipped row the recompute reads.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from lmcompact.compaction.holes import Hole, skip_holes
from lmcompact.compaction.page_layout import make_layout
from lmcompact.compaction.per_head import masked_decode_attention
from lmcompact.compaction.per_head_attention import PerHeadAttention

BS, H, G, D, L = 8, 2, 2, 4, 2
SCALE = 1 / math.sqrt(D)

# batch rows: a (per-head, decode), b (no per-head counts), c (per-head, 3 queries)
ROWS = {
    "a": [3, 9, 1, 14, 6, 2, 11],  # kept blocks 0-1, hole 2-4, tail 5-6
    "b": [4, 5, 7, 8],
    "c": [10, 12, 13, 15, 16, 17, 18, 19],  # kept block 0 (+1 reserved), hole 2-5, tail 6-7
}
HOLES = {3: Hole(3, 2, 3), 10: Hole(10, 2, 4)}
LOGICAL = {"a": 7 * BS - 2, "b": 4 * BS - 5, "c": 8 * BS - 1}
Q_LEN = {"a": 1, "b": 1, "c": 3}
COUNTS = {
    "a": torch.tensor([[5, 16], [9, 1]]),
    "c": torch.tensor([[16, 3], [7, 12]]),
}


def batch(layout_name: str) -> tuple[PerHeadAttention, SimpleNamespace, dict[str, torch.Tensor]]:
    layout = make_layout(layout_name, BS)
    gen = torch.Generator().manual_seed(0)
    kv = {f"l{i}": torch.randn(24, H, BS, 2 * D, generator=gen) for i in range(L)}
    perhead = PerHeadAttention(
        layout, kv, {f"l{i}": i for i in range(L)}, {f"l{i}": SCALE for i in range(L)}, D
    )
    width = max(len(r) for r in ROWS.values())
    table = torch.zeros(3, width, dtype=torch.int32)
    for i, row in enumerate(ROWS.values()):
        table[i, : len(row)] = torch.tensor(row, dtype=torch.int32)
    lens = torch.tensor(list(LOGICAL.values()), dtype=torch.int32)
    edited = skip_holes(table, lens, 3, HOLES, BS)
    assert edited is not None
    starts = torch.tensor([0, 1, 2, 5], dtype=torch.int32)
    metadata = SimpleNamespace(query_start_loc=starts, block_table=edited[0], seq_lens=edited[1])
    return perhead, metadata, kv


@pytest.mark.parametrize("layout_name", ["head_major_kt", "token_major"])
def test_recompute_overwrites_per_head_rows_only(layout_name: str) -> None:
    perhead, metadata, kv = batch(layout_name)
    perhead.add("a", 3, COUNTS["a"], 2 * BS)
    perhead.add("c", 10, COUNTS["c"], 2 * BS)
    perhead.begin_step(HOLES, forgotten=[])
    gen = torch.Generator().manual_seed(1)
    query = torch.randn(5, H * G * D, generator=gen)
    for i, name in enumerate(kv):
        output = torch.randn(5, H * G * D, generator=gen)
        vllm_b = output[1].clone()
        perhead(name, query, metadata, output)
        assert torch.equal(output[1], vllm_b)  # row b untouched
        for rid, rows in (("a", slice(0, 1)), ("c", slice(2, 5))):
            hole = HOLES[ROWS[rid][0]]
            want = masked_decode_attention(
                query[rows].view(-1, H * G, D),
                kv[name],
                perhead.layout,
                ROWS[rid],
                COUNTS[rid][i],
                hole.start_block * BS + hole.num_blocks * BS,
                LOGICAL[rid],
                SCALE,
                reserved=2 * BS,
            )
            torch.testing.assert_close(output[rows].view(-1, H * G, D), want)
    assert perhead.stats == {"requests": 2, "calls": 2, "query_rows": 8}


def test_forgotten_requests_are_not_recomputed() -> None:
    perhead, metadata, _ = batch("head_major_kt")
    perhead.add("a", 3, COUNTS["a"], 2 * BS)
    assert set(perhead.entries) == {"a"}
    perhead.begin_step(HOLES, forgotten=["a"])
    output = torch.randn(5, H * G * D)
    before = output.clone()
    perhead("l0", torch.randn(5, H * G * D), metadata, output)
    assert torch.equal(output, before) and perhead.entries == {}


def test_inconsistent_state_raises() -> None:
    perhead, metadata, _ = batch("head_major_kt")
    with pytest.raises(ValueError, match="overflow"):
        perhead.add("a", 3, COUNTS["a"], BS)
    with pytest.raises(ValueError, match="block-aligned base"):
        perhead.add("a", 3, COUNTS["a"], 2 * BS, base=2)
    with pytest.raises(ValueError, match="counts must be"):
        perhead.add("a", 3, COUNTS["a"][0], 2 * BS)
    perhead.add("a", 3, COUNTS["a"], 3 * BS)  # the hole starts at 2 blocks
    perhead.begin_step(HOLES, forgotten=[])
    with pytest.raises(RuntimeError, match="per-head cells end"):
        perhead("l0", torch.randn(5, H * G * D), metadata, torch.zeros(5, H * G * D))
