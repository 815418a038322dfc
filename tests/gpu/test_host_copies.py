"""The step edits' index copies on CUDA (lmcompact.compaction.host_copies): queued behind
the GPU's work, not waiting for it (skipped without a GPU)."""

from __future__ import annotations

import time

import pytest
import torch

from lmcompact.compaction.holes import cut_holes_in_place
from lmcompact.compaction.host_copies import values_on_device
from tests.gpu.test_store_transfer import sleep_cycles

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_index_copies_and_hole_cuts_do_not_wait_for_the_previous_step() -> None:
    device = torch.device("cuda")
    table = torch.arange(40, dtype=torch.int32, device=device).view(4, 10)
    lens = torch.full((4,), 160, dtype=torch.int32, device=device)
    values_on_device([1, 2], torch.int64, device)  # warm: pinned blocks, kernels loaded
    cut_holes_in_place(table.clone(), lens.clone(), [1], [2], [3], 16)
    torch.cuda.synchronize()
    torch.cuda._sleep(sleep_cycles())  # "the previous step", still running below
    start = time.perf_counter()
    index = values_on_device([2, 0], torch.int64, device)
    cut_holes_in_place(table, lens, [1, 3], [2, 5], [3, 1], 16)
    queued = time.perf_counter() - start
    assert not torch.cuda.current_stream().query()
    assert queued < 0.05, f"the edits took {queued:.3f}s: they waited for the GPU"
    assert index.tolist() == [2, 0]
    assert table[1, :4].tolist() == [10, 11, 15, 16]
    assert table[3, :6].tolist() == [30, 31, 32, 33, 34, 36]
    assert lens.tolist() == [160, 112, 160, 144]
