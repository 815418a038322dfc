"""RaggedKV: building from dense + plans, append, gather, dense round trip, bytes."""

from __future__ import annotations

import pytest
import torch

from lmcompact.layout import RaggedKV, RaggedLayer, ragged_from_dense
from lmcompact.plan import KeepPlan


def _dense(b: int, h: int, t: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(b, h, t, d, generator=g), torch.randn(b, h, t, d, generator=g)


def test_from_dense_keeps_exactly_the_plan() -> None:
    keys, values = _dense(2, 2, 6, 4)
    plans = [
        KeepPlan.from_lists(6, [[[0, 3], []]]),
        KeepPlan.from_lists(6, [[[5], [0, 1, 2, 3, 4, 5]]]),
    ]
    kv = RaggedKV.from_dense([keys], [values], plans)
    layer = kv.layers[0]
    assert layer.lengths().tolist() == [[2, 0], [1, 6]]
    k, v, pos = layer.segment(0, 0)
    assert torch.equal(k, keys[0, 0, [0, 3]]) and torch.equal(v, values[0, 0, [0, 3]])
    assert pos.tolist() == [0, 3]
    assert layer.segment(0, 1)[0].shape == (0, 4)


def test_to_dense_restores_kept_positions() -> None:
    keys, values = _dense(1, 3, 9, 2)
    plan = KeepPlan.from_lists(9, [[[1, 4], [0], [2, 3, 8]]])
    layer = RaggedKV.from_dense([keys], [values], [plan]).layers[0]
    dense_k, dense_v, mask = layer.to_dense(9)
    assert torch.equal(mask[0], plan.masks()[0])
    assert torch.equal(dense_k[mask], keys[mask])
    assert torch.equal(dense_v[mask], values[mask])
    assert float(dense_k[~mask].abs().sum()) == 0.0


def test_append_puts_new_tokens_at_each_segment_end() -> None:
    keys, values = _dense(2, 2, 5, 3)
    plans = [KeepPlan.from_lists(5, [[[0, 4], [2]]]), KeepPlan.from_lists(5, [[[], [1, 3]]])]
    layer = RaggedKV.from_dense([keys], [values], plans).layers[0]
    new_k, new_v = _dense(2, 2, 2, 3)
    grown = layer.append(new_k, new_v, torch.tensor([[5, 6], [5, 6]]))
    assert grown.lengths().tolist() == [[4, 3], [2, 4]]
    for b in range(2):
        for h in range(2):
            k, v, pos = grown.segment(b, h)
            old_k, _, old_pos = layer.segment(b, h)
            assert torch.equal(k[: old_k.shape[0]], old_k)
            assert torch.equal(k[-2:], new_k[b, h]) and torch.equal(v[-2:], new_v[b, h])
            assert pos.tolist() == [*old_pos.tolist(), 5, 6]


def test_gather_and_scores_follow_tokens() -> None:
    keys, values = _dense(1, 2, 4, 2)
    layer = ragged_from_dense(keys, values, [[torch.arange(4), torch.tensor([1, 2])]])
    layer.accumulate_scores(torch.arange(6, dtype=torch.float32))
    kept = layer.gather([torch.tensor([1, 3]), torch.tensor([0])])
    assert kept.positions.tolist() == [1, 3, 1]
    assert kept.scores is not None and kept.scores.tolist() == [1.0, 3.0, 4.0]
    assert kept.lengths().tolist() == [[2, 1]]


def test_nbytes_is_exact_and_shrinks_with_plan() -> None:
    keys, values = _dense(1, 2, 100, 8)
    full = RaggedKV.from_dense([keys], [values], [KeepPlan.full(1, 2, 100)])
    half = RaggedKV.from_dense(
        [keys], [values], [KeepPlan.from_lists(100, [[list(range(50)), list(range(50, 100))]])]
    )
    per_token = 2 * 8 * 4 + 8  # K + V in fp32 plus the int64 position
    offsets = 3 * 8
    assert full.nbytes() == 200 * per_token + offsets
    assert half.nbytes() == 100 * per_token + offsets
    assert half.kv_nbytes() * 2 == full.kv_nbytes()


def test_bad_shapes_raise() -> None:
    keys, values = _dense(1, 2, 4, 2)
    with pytest.raises(ValueError, match="one KeepPlan per sequence"):
        RaggedKV.from_dense([keys], [values], [])
    with pytest.raises(ValueError, match="plan is for 1 layers x 3 kv heads"):
        RaggedKV.from_dense([keys], [values], [KeepPlan.full(1, 3, 4)])
    layer = RaggedKV.from_dense([keys], [values], [KeepPlan.full(1, 2, 4)]).layers[0]
    with pytest.raises(ValueError, match="do not match the layer"):
        layer.append(torch.zeros(1, 3, 1, 2), torch.zeros(1, 3, 1, 2), torch.zeros(1, 1))
    with pytest.raises(ValueError, match="cu_seqlens must run from 0 to N"):
        RaggedLayer(keys[0, 0], values[0, 0], torch.arange(4), torch.tensor([0, 3]), 1)
