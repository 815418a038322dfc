"""Host-to-device copies of small index tensors (lmcompact.compaction.host_copies); the GPU
counterpart, that they do not wait for queued work, is tests/gpu/test_host_copies.py."""

from __future__ import annotations

import torch

from lmcompact.compaction.host_copies import host_to_device, is_pinned, on_device, values_on_device

CPU = torch.device("cpu")


def test_values_keep_their_order_shape_and_dtype() -> None:
    got = values_on_device([[3, 1], [0, 7]], torch.int32, CPU)
    assert got.dtype == torch.int32 and got.tolist() == [[3, 1], [0, 7]]
    assert values_on_device([5, 2, 9], torch.int64, CPU).tolist() == [5, 2, 9]


def test_a_tensor_already_there_is_not_copied() -> None:
    tensor = torch.arange(4)
    assert on_device(CPU, tensor) is tensor
    assert host_to_device(CPU, tensor) is tensor
    assert not is_pinned(tensor)
