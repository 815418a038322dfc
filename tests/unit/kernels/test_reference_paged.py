"""The paged torch reference against the core ragged reference, on CPU."""

from __future__ import annotations

import pytest
import torch

from lmcompact.attention.reference import ragged_attention
from lmcompact.kernels.reference_paged import paged_attention_reference, visible_slots
from lmcompact.kernels.synthetic import densify, random_paged_case
from lmcompact.layout.paged import PagedLengths, vllm_kv_views

CASES = [
    # kept (B x Hkv), prefix, tail, q_len
    ([[5, 0, 1], [16, 7, 3]], [16, 32], [3, 9], [1, 1]),
    ([[0, 1], [9, 2]], [12, 16], [40, 33], [30, 30]),
    ([[0], [0]], [0, 8], [4, 5], [2, 2]),
]


@pytest.mark.parametrize("layout", ["vllm", "flash"])
@pytest.mark.parametrize("index", range(len(CASES)))
def test_paged_reference_matches_ragged_reference(layout: str, index: int) -> None:
    kept, prefix, tail, q_len = CASES[index]
    case = random_paged_case(
        kept, prefix, tail, q_len, group=3, head_dim=16, block_size=4, layout=layout, seed=index
    )
    out, mass = paged_attention_reference(
        *case.attention_args(),
        return_key_mass=True,
    )
    assert mass is not None
    assert not torch.isnan(out).any(), "a poisoned (hole or padding) slot was read"
    layer, query_positions = case.to_ragged()
    b, s = query_positions.shape
    hq, d = case.queries.shape[1:]
    queries = case.queries.view(b, s, hq, d).transpose(1, 2)
    want, want_mass = ragged_attention(queries, layer, query_positions, return_key_mass=True)
    assert want_mass is not None
    torch.testing.assert_close(out, want.transpose(1, 2).reshape(b * s, hq, d))
    flat = torch.cat(
        [
            mass[bb, h, visible_slots(case.lengths, bb, h)]
            for bb in range(b)
            for h in range(len(kept[0]))
        ]
    )
    torch.testing.assert_close(flat, want_mass)


def test_mass_is_zero_outside_visible_slots() -> None:
    case = random_paged_case([[3, 8]], [8], [5], [2], group=2, head_dim=8, block_size=4)
    _, mass = paged_attention_reference(
        *case.attention_args(),
        return_key_mass=True,
    )
    assert mass is not None
    assert float(mass[0, 0, 3:8].abs().sum()) == 0.0  # head 0's hole
    torch.testing.assert_close(mass.sum(-1), torch.full((1, 2), 2.0))  # 2 queries, rows sum to 1


def test_vllm_views_are_token_major_k_then_v() -> None:
    cache = torch.arange(2 * 3 * 4 * 10, dtype=torch.float32).view(2, 3, 4, 10)
    k, v = vllm_kv_views(cache)
    assert k.shape == (2, 4, 3, 5)
    torch.testing.assert_close(k[1, 2, 0], cache[1, 0, 2, :5])
    torch.testing.assert_close(v[1, 2, 0], cache[1, 0, 2, 5:])
    with pytest.raises(ValueError, match="2\\*head_dim"):
        vllm_kv_views(torch.zeros(2, 3, 4, 5))


def test_lengths_validation_names_the_problem() -> None:
    good = PagedLengths(torch.tensor([[2, 4]]), torch.tensor([4]), torch.tensor([9]))
    good.validate(2, 12, 4)
    with pytest.raises(ValueError, match="kept"):
        PagedLengths(torch.tensor([[5, 4]]), torch.tensor([4]), torch.tensor([9])).validate(
            2, 12, 4
        )
    with pytest.raises(ValueError, match="multiple of block_size"):
        PagedLengths(torch.tensor([[2, 3]]), torch.tensor([3]), torch.tensor([9])).validate(
            2, 12, 4
        )
    with pytest.raises(ValueError, match="seq_len"):
        good.validate(2, 8, 4)


@pytest.mark.parametrize("layout", ["vllm", "flash"])
@pytest.mark.parametrize("base", [0, 4])
@pytest.mark.parametrize("shrink", [False, True], ids=["tail-in-place", "tail-after-cells"])
def test_dense_cells_give_the_same_attention_as_padded_slots(
    layout: str, base: int, shrink: bool
) -> None:
    kept = [[5, 4, 13], [16, 7, 30]]  # a head keeping more than the others' mean
    case = random_paged_case(
        kept, [16, 32], [3, 9], [1, 3], group=2, head_dim=8, block_size=4, layout=layout
    )
    dense = densify(case, base, shrink)
    if shrink:  # the tail moved up: head 2 keeps more keys than the slots before it
        assert dense.lengths.tail_start.tolist() == [8, 20]  # 22 and 53 cells of 12 a block
        assert bool((dense.lengths.kept.max(dim=1).values > dense.lengths.tail_start).all())
    want, _ = paged_attention_reference(*case.attention_args())
    got, _ = paged_attention_reference(*dense.attention_args())
    assert not torch.isnan(got).any()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert dense.lengths.dense
    # head cells that run into the tail's blocks are refused
    bad = PagedLengths(
        dense.lengths.kept,
        dense.lengths.tail_start,
        dense.lengths.seq_len,
        dense.lengths.dense_start + 1000,
        dense.lengths.dense_base,
    )
    with pytest.raises(ValueError, match="dense cells"):
        bad.validate(3, case.block_table.shape[1] * 4, 4)
