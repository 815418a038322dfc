"""Compaction and defragmentation planning plus the torch move reference, on CPU."""

from __future__ import annotations

import torch

from lmcompact.kernels import dispatch
from lmcompact.kernels.moves import SlotMoves, compaction_moves, plan_defragment
from lmcompact.kernels.synthetic import random_paged_case


def test_compaction_moves_segments() -> None:
    moves = compaction_moves(
        [
            torch.tensor([1, 4]),
            torch.tensor([], dtype=torch.int64),
            torch.tensor([0, 2, 3]),
            torch.tensor([7]),
        ],
        num_kv_heads=2,
    )
    assert moves.cu.tolist() == [0, 2, 2, 5, 6]
    assert moves.request.tolist() == [0, 0, 1, 1]
    assert moves.head.tolist() == [0, 1, 0, 1]
    assert moves.max_count == 3
    seg, rank = moves.token_segments()
    assert seg.tolist() == [0, 0, 2, 2, 2, 3]
    assert rank.tolist() == [0, 1, 0, 1, 2, 0]


def test_in_place_compaction_packs_kept_tokens_in_order() -> None:
    case = random_paged_case(
        [[8, 8]], [8], [4], [1], group=1, head_dim=4, block_size=4, poison=False
    )
    keep = [torch.tensor([1, 5, 6, 9]), torch.tensor([0, 7])]
    before_k = case.key_pool.clone()
    table = case.block_table[0].long()

    def slot(pool: torch.Tensor, s: int, h: int) -> torch.Tensor:
        return pool[table[s // 4], s % 4, h]

    with dispatch.force_reference():
        counts = dispatch.compact_heads(case.key_pool, case.value_pool, case.block_table, keep)
    assert counts.tolist() == [[4, 2]]
    for h, idx in enumerate(keep):
        for new, old in enumerate(idx.tolist()):
            torch.testing.assert_close(slot(case.key_pool, new, h), slot(before_k, old, h))


def test_defragment_frees_hole_blocks_and_keeps_attention() -> None:
    kept = [[5, 1, 0], [16, 9, 12], [0, 0, 0]]
    case = random_paged_case(
        kept,
        [32, 16, 0],
        [3, 6, 9],
        [1, 1, 1],
        group=2,
        head_dim=8,
        block_size=4,
        poison=False,
        seed=4,
    )
    # give every request its own hole blocks (as a request that has not freed them yet)
    held = case.block_table.clone()
    nb = case.key_pool.shape[0]
    extra = int((held == held[0, 2]).sum())
    cache = torch.cat([case.cache, torch.randn(extra, *case.cache.shape[1:])])
    k, v = cache[..., :8].transpose(1, 2), cache[..., 8:].transpose(1, 2)
    held[held == held[0, 2]] = torch.arange(nb, nb + extra, dtype=held.dtype)
    args = (case.queries, k, v)
    with dispatch.force_reference():
        before, _ = dispatch.paged_attention(*args, held, case.cu_seqlens_q, case.lengths)
        plan = dispatch.defragment(k, v, held, case.lengths)
        after, _ = dispatch.paged_attention(
            *args, plan.block_table, case.cu_seqlens_q, plan.lengths
        )
    torch.testing.assert_close(after, before)
    # request 0: kept blocks 2 + tail 1; request 1: 4 + 2; request 2: tail 3
    assert plan.num_blocks.tolist() == [3, 6, 3]
    assert plan.blocks_after == 12
    assert plan.blocks_before == 8 + 1 + 4 + 2 + 3
    assert plan.blocks_before - plan.blocks_after == 6
    assert plan.lengths.tail_start.tolist() == [8, 16, 0]
    assert len(set(plan.freed_blocks.tolist()) & set(range(12))) == 0


def test_defrag_plan_moves_are_consistent() -> None:
    case = random_paged_case([[3, 6]], [8], [5], [1], group=1, head_dim=4, block_size=4)
    plan = plan_defragment(case.block_table, case.lengths, 4)
    assert isinstance(plan.moves, SlotMoves)
    assert plan.moves.num_tokens == 3 + 6 + 2 * 5
    assert plan.moves.dst_start.tolist() == [0, 8, 0, 8]
