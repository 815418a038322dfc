"""KeepPlan: validation, accounting and plain-dict round trips."""

from __future__ import annotations

import msgpack
import pytest
import torch

from lmcompact.plan import KeepPlan


def test_full_plan_accounting() -> None:
    plan = KeepPlan.full(num_layers=3, num_kv_heads=2, seq_len=10)
    assert plan.total_kept == 60
    assert plan.compression_ratio == 1.0
    assert plan.is_uniform
    assert plan.bytes_saved(head_dim=8, dtype=torch.float16) == 0


def test_ragged_plan_ratio_and_bytes() -> None:
    plan = KeepPlan.from_lists(8, [[[0, 1, 7], [2]], [[], [0, 1, 2, 3, 4, 5, 6, 7]]])
    assert plan.kept_counts().tolist() == [[3, 1], [0, 8]]
    assert plan.compression_ratio == pytest.approx(12 / 32)
    assert not plan.is_uniform
    # 20 dropped tokens x (K + V) x head_dim 4 x 2 bytes
    assert plan.bytes_saved(head_dim=4, dtype=torch.bfloat16) == 20 * 2 * 4 * 2


def test_from_lists_sorts_and_deduplicates() -> None:
    plan = KeepPlan.from_lists(5, [[[4, 1, 1, 0]]])
    assert plan.kept[0][0].tolist() == [0, 1, 4]


def test_msgpack_round_trip() -> None:
    plan = KeepPlan.from_lists(6, [[[0, 5], [1, 2, 3]], [[4], []]])
    packed = msgpack.packb(plan.to_dict())
    assert KeepPlan.from_dict(msgpack.unpackb(packed)) == plan


def test_masks_round_trip() -> None:
    plan = KeepPlan.from_lists(6, [[[0, 5], [1, 2, 3]]])
    assert KeepPlan.from_masks(plan.masks()) == plan


@pytest.mark.parametrize(
    ("kept", "match"),
    [
        ([[[0, 9]]], r"outside \[0, 5\)"),
        ([[[-1]]], r"outside \[0, 5\)"),
        ([[[0], [1]], [[0]]], "every layer must list the same number of heads"),
    ],
)
def test_invalid_plans_raise(kept: list[list[list[int]]], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        KeepPlan.from_lists(5, kept)


def test_unsorted_tensor_rejected() -> None:
    with pytest.raises(ValueError, match="strictly increasing"):
        KeepPlan(seq_len=5, kept=((torch.tensor([3, 1]),),))


def test_validate_for_wrong_model_shape() -> None:
    plan = KeepPlan.full(2, 3, 4)
    plan.validate_for(2, 3, 4)
    with pytest.raises(ValueError, match="plan is for 2 layers x 3 kv heads, the cache has 30"):
        plan.validate_for(30, 3)
    with pytest.raises(ValueError, match="plan is for 4 tokens, the cache holds 7"):
        plan.validate_for(2, 3, 7)


def test_foreign_dict_rejected() -> None:
    with pytest.raises(ValueError, match="not a KeepPlan dict"):
        KeepPlan.from_dict({"version": 99, "seq_len": 1, "kept": [[[0]]]})
