"""Page-locked host buffers held by lmcompact for the save path's device-to-host copies.

A copy from the GPU into pageable memory is synchronous, and a fresh page-locked allocation
(``cudaHostAlloc``) makes the device synchronize and costs about a second per few GiB. torch's
host allocator caches freed pinned blocks, but every CUDA graph capture empties that cache
(``torch.cuda.graph`` calls ``torch.accelerator.empty_host_cache()``), and vLLM captures its
graphs after the connector registered its KV caches: a warm-up through torch's cache is gone
before the first request. This pool owns its buffers: :meth:`PinnedBufferPool.reserve`
allocates them at start-up, :meth:`PinnedBufferPool.take` hands one out (a buffer is taken
back automatically once no tensor views it any more), and a miss allocates a new one that
stays in the pool.
"""

from __future__ import annotations

import threading

import torch

_use_count = getattr(torch._C, "_storage_Use_Count", None)

MIN_CLASS = 1 << 12
"""Smallest buffer size class, bytes."""

LARGEST_STEP = 4
"""A request may take a free buffer of up to this many times its size class (rather
than allocate)."""


def size_class(nbytes: int) -> int:
    """The power-of-two size class that holds ``nbytes`` bytes."""
    return max(MIN_CLASS, 1 << max(0, nbytes - 1).bit_length())


class PinnedBufferPool:
    """Pinned host buffers by power-of-two size class, kept for the life of the pool.

    Args:
        pin_memory: page-locked buffers (False only where CUDA is absent: unit tests of
            the bookkeeping).

    Thread-safe. A buffer handed out by :meth:`take` returns to the free lists by itself
    once every tensor viewing it is gone (its storage's use count is back to the pool's
    own reference); where torch cannot report use counts, buffers are never reused and
    each take allocates.
    """

    def __init__(self, pin_memory: bool = True) -> None:
        self.pin_memory = pin_memory
        self._free: dict[int, list[torch.Tensor]] = {}
        self._lent: list[torch.Tensor] = []
        self._baseline: int | None = None
        self._lock = threading.Lock()
        self.allocations = 0
        """Buffers allocated (``cudaHostAlloc``) since the pool was made."""
        self.held_bytes = 0
        """Bytes of every buffer the pool owns, free or lent."""

    def reserve(self, nbytes: int, count: int) -> int:
        """Make sure ``count`` buffers of ``nbytes``' class are free now; returns the bytes
        allocated for that."""
        size = size_class(nbytes)
        with self._lock:
            self._reclaim()
            missing = max(0, count - len(self._free.get(size, [])))
            fresh = [self._allocate(size) for _ in range(missing)]
            self._free.setdefault(size, []).extend(fresh)
        return missing * size

    def take(self, shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A pinned host tensor of ``shape`` and ``dtype`` viewing a pool buffer (a free one
        of its class or up to :data:`LARGEST_STEP` times larger, else a new one)."""
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        size = size_class(nbytes)
        with self._lock:
            buffer = self._pop_free(size)
            if buffer is None:
                self._reclaim()
                buffer = self._pop_free(size)
            if buffer is None:
                buffer = self._allocate(size)
            self._lent.append(buffer)
        return buffer[:nbytes].view(dtype).view(shape)

    @property
    def free_bytes(self) -> int:
        with self._lock:
            self._reclaim()
            return sum(size * len(bufs) for size, bufs in self._free.items())

    def _pop_free(self, size: int) -> torch.Tensor | None:
        candidate = size
        while candidate <= size * LARGEST_STEP:
            bufs = self._free.get(candidate)
            if bufs:
                return bufs.pop()
            candidate *= 2
        return None

    def _reclaim(self) -> None:
        """Move lent buffers that nothing views any more back to the free lists."""
        if _use_count is None or self._baseline is None:
            return
        still_lent = []
        for buffer in self._lent:
            if int(_use_count(buffer.untyped_storage()._cdata)) <= self._baseline:
                self._free.setdefault(buffer.numel(), []).append(buffer)
            else:
                still_lent.append(buffer)
        self._lent = still_lent

    def _allocate(self, size: int) -> torch.Tensor:
        buffer = torch.empty(size, dtype=torch.uint8, pin_memory=self.pin_memory)
        if self._baseline is None and _use_count is not None:
            self._baseline = int(_use_count(buffer.untyped_storage()._cdata))
        self.allocations += 1
        self.held_bytes += size
        return buffer
