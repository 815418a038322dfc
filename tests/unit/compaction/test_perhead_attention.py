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
from lmcompact.kernels.entry_attention import entry_attention_reference
from lmcompact.layout.paged import vllm_kv_views

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
    assert perhead.stats == {"requests": 2, "calls": 2, "query_rows": 8, "rows_cut_to_tail": 0}


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


@pytest.mark.parametrize("queries", [False, True])
def test_tail_only_rows_leave_vllm_the_tail_and_the_entry_launch_the_hole_cut_copies(
    queries: bool,
) -> None:
    """Full-graph runs: vLLM's kernel reads per-head rows cut to their tail (given the
    step's query offsets: to the block of their first query), the entry launch (here its
    torch reference) reads copies of the hole-cut rows and gives the masked reference's
    rows; row b is left as it was."""
    perhead, metadata, kv = batch("token_major")
    perhead.attend_in_place(capacity=4, max_keys=8 * BS)
    perhead.tail_only = True
    perhead.add("a", 3, COUNTS["a"], 2 * BS)
    perhead.add("c", 10, COUNTS["c"], 2 * BS)
    # the runner's fixed buffers (max_num_reqs rows); the step reads leading views
    buffer = torch.zeros(6, metadata.block_table.shape[1], dtype=torch.int32)
    lens_buffer = torch.zeros(6, dtype=torch.int32)
    # an earlier step with the rows in another order: its copy must not survive
    buffer[:3] = metadata.block_table.flip(0)
    lens_buffer[:3] = metadata.seq_lens.flip(0)
    perhead.cut_to_tails(["c", "b", "a"], buffer[:3], lens_buffer[:3], HOLES)
    buffer[:3] = metadata.block_table
    lens_buffer[:3] = metadata.seq_lens
    table, lens = buffer[:3], lens_buffer[:3]
    hole_cut = table.clone(), lens.clone()
    starts = metadata.query_start_loc if queries else None
    cut = perhead.cut_to_tails(["a", "b", "c"], table, lens, HOLES, starts)
    perhead.begin_step(HOLES, forgotten=[])
    assert cut == {0: 2 * BS, 2: 2 * BS}  # at least the tail's start
    if queries:  # a: 1 query of 30 hole-cut keys, c: 3 of 31 -> their last block
        assert table[0, :2].tolist() == [ROWS["a"][6], 0] and int(lens[0]) == 6
        assert table[2, :2].tolist() == [ROWS["c"][7], 0] and int(lens[2]) == 7
    else:
        assert table[0, :2].tolist() == ROWS["a"][5:7] and int(lens[0]) == LOGICAL["a"] - 5 * BS
        assert table[2, :2].tolist() == ROWS["c"][6:8] and int(lens[2]) == LOGICAL["c"] - 6 * BS
    assert torch.equal(table[1], hole_cut[0][1]) and int(lens[1]) == int(hole_cut[1][1])
    step = SimpleNamespace(block_table=table, seq_lens=lens)
    copy_table, copy_lens = perhead._entry_inputs(step, capturing=False)
    assert torch.equal(copy_table, hole_cut[0]) and torch.equal(copy_lens, hole_cut[1])
    assert copy_table.data_ptr() != table.data_ptr()
    assert perhead.stats["rows_cut_to_tail"] == 4
    gen = torch.Generator().manual_seed(2)
    query = torch.randn(5, H * G, D, generator=gen)
    for i, name in enumerate(kv):
        key_pool, value_pool = vllm_kv_views(kv[name])
        output = torch.zeros(5, H * G, D)
        assert perhead.tables is not None
        entry_attention_reference(
            query,
            key_pool,
            value_pool,
            copy_table,
            metadata.query_start_loc,
            copy_lens,
            perhead.tables.layers[i],
            output,
            scale=SCALE,
            num_reqs=3,
        )
        assert not output[1].any()  # row b: not a per-head request
        for rid, rows in (("a", slice(0, 1)), ("c", slice(2, 5))):
            hole = HOLES[ROWS[rid][0]]
            want = masked_decode_attention(
                query[rows],
                kv[name],
                perhead.layout,
                ROWS[rid],
                COUNTS[rid][i],
                (hole.start_block + hole.num_blocks) * BS,
                LOGICAL[rid],
                SCALE,
                reserved=2 * BS,
            )
            torch.testing.assert_close(output[rows], want)


def test_tail_only_refuses_tables_the_runner_never_copied() -> None:
    perhead, metadata, _ = batch("token_major")
    perhead.attend_in_place(capacity=4, max_keys=8 * BS)
    with pytest.raises(RuntimeError, match="tail_only"):
        perhead.cut_to_tails(["a"], metadata.block_table, metadata.seq_lens, HOLES)
    perhead.tail_only = True
    perhead.add("a", 3, COUNTS["a"], 2 * BS)
    perhead.begin_step(HOLES, forgotten=[])
    with pytest.raises(RuntimeError, match="never copied"):
        perhead._entry_inputs(metadata, capturing=False)
    table, lens = perhead._entry_inputs(metadata, capturing=True)  # a capture may read it
    assert not table.any() and not lens.any()
