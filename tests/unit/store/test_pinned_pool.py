"""The bookkeeping of :class:`PinnedBufferPool` with pageable buffers (no CUDA here); the
page-locked pool serving real copies is tests/gpu/test_save_copies.py."""

from __future__ import annotations

import torch

from lmcompact.store.pinned_pool import MIN_CLASS, PinnedBufferPool, size_class


def test_size_classes_are_powers_of_two_from_the_minimum() -> None:
    assert size_class(1) == MIN_CLASS
    assert size_class(MIN_CLASS + 1) == 2 * MIN_CLASS
    assert size_class(1 << 20) == 1 << 20
    assert size_class((1 << 20) + 1) == 1 << 21


def test_reserved_buffers_serve_takes_and_come_back_when_unviewed() -> None:
    pool = PinnedBufferPool(pin_memory=False)
    assert pool.reserve(3 << 18, 2) == 2 << 20  # two 1 MiB buffers
    assert pool.reserve(1 << 20, 2) == 0  # already there
    a = pool.take((256, 1024), torch.float32)  # exactly 1 MiB
    b = pool.take((100, 3), torch.bfloat16)  # 600 B: class 4 KiB has none, 1 MiB is too big
    assert pool.allocations == 3 and a.shape == (256, 1024) and b.dtype == torch.bfloat16
    c = pool.take((1 << 18,), torch.float32)  # the second reserved 1 MiB buffer
    d = pool.take((1 << 18,), torch.float32)  # none free: a new one
    assert pool.allocations == 4 and pool.free_bytes == 0
    a.fill_(1.0)
    view = a[3:]  # a view keeps the buffer lent
    del a, c, d
    assert pool.free_bytes == 2 << 20
    e = pool.take((2048,), torch.float32)  # 8 KiB: a free 1 MiB is more than 4x: allocate
    assert pool.allocations == 5
    del view, b, e
    assert pool.free_bytes == (3 << 20) + MIN_CLASS + 8192
    assert pool.held_bytes == pool.free_bytes


def test_a_larger_free_class_within_four_times_is_used() -> None:
    pool = PinnedBufferPool(pin_memory=False)
    pool.reserve(1 << 20, 1)
    t = pool.take((300_000,), torch.uint8)  # class 512 KiB: the 1 MiB buffer serves it
    assert pool.allocations == 1 and t.numel() == 300_000
