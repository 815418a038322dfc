"""Block pool: fixed-size block ids with exact reference counts.

The pool hands out block ids from a free list and counts how many block-table
entries point at each block. Beams that share a prefix share its blocks, so a
block is freed only when its last reference goes::

    refcount   [ 4  4  4  4 | 1  2  1 | 0  0  0 ... ]
    block id     0  1  2  3   4  5  6   7  8  9
                 prompt,       beams'    free list
                 all 4 beams   tails

Counts never go below zero and an id is never freed twice: every such error
raises (a clamped count would hide a use-after-free). The pool knows nothing of
K/V tensors; :class:`~lmcompact.hf.paged.storage.KVStorage` holds the data.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)


class BlockPoolExhausted(RuntimeError):
    """Raised when an allocation needs more blocks than are free."""


class BlockPool:
    """Free list and reference counts for ``num_blocks`` blocks.

    Freed blocks are reused first (LIFO) and a fresh pool hands out ascending ids,
    so a prompt written into a fresh pool lands in consecutive blocks.

    Args:
        num_blocks: Blocks in the pool (> 0).
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be > 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self.refcount = torch.zeros(num_blocks, dtype=torch.int64)
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self.peak_used = 0

    # ----------------------------------------------------------------- queries
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def is_pristine(self) -> bool:
        """True when every block is free and every count is zero (the start state)."""
        return self.num_free == self.num_blocks and not bool(self.refcount.any())

    # ------------------------------------------------------------- operations
    def allocate(self, count: int) -> torch.Tensor:
        """Take ``count`` free blocks, each with one reference; returns ``(count,)`` int64 ids."""
        if count < 0:
            raise ValueError(f"count must be >= 0, got {count}")
        if count > len(self._free):
            raise BlockPoolExhausted(
                f"need {count} blocks but only {len(self._free)} of {self.num_blocks} are free; "
                "build the cache with more num_blocks"
            )
        ids = [self._free.pop() for _ in range(count)]
        out = torch.tensor(ids, dtype=torch.int64)
        self.refcount[out] = 1
        self.peak_used = max(self.peak_used, self.num_used)
        return out

    def incref(self, ids: torch.Tensor) -> None:
        """Add one reference per occurrence of each id (ids may repeat)."""
        ids = ids.reshape(-1).to(device="cpu", dtype=torch.int64)
        if ids.numel() == 0:
            return
        self._check_range(ids)
        if bool((self.refcount[ids] <= 0).any()):
            bad = ids[self.refcount[ids] <= 0].unique().tolist()
            raise RuntimeError(f"incref of free blocks {bad[:8]}: they were never allocated")
        self.refcount.index_add_(0, ids, torch.ones_like(ids))

    def decref(self, ids: torch.Tensor) -> None:
        """Drop one reference per occurrence; blocks that reach zero go back to the free list."""
        ids = ids.reshape(-1).to(device="cpu", dtype=torch.int64)
        if ids.numel() == 0:
            return
        self._check_range(ids)
        after = self.refcount.clone()
        after.index_add_(0, ids, -torch.ones_like(ids))
        self._commit(after, ids)

    def _commit(self, after: torch.Tensor, dropped: torch.Tensor) -> None:
        """Install new counts; ``dropped`` ids that reached zero go back to the free list."""
        if bool((after < 0).any()):
            bad = torch.nonzero(after < 0).flatten().tolist()
            counts = self.refcount[bad[:8]].tolist()
            raise RuntimeError(f"decref below zero for blocks {bad[:8]} (refcounts {counts})")
        self.refcount = after
        touched = dropped.unique()
        freed = touched[after[touched] == 0]
        self._free.extend(freed.flip(0).tolist())

    def swap(self, add: torch.Tensor, drop: torch.Tensor) -> None:
        """:meth:`incref` ``add`` and :meth:`decref` ``drop`` in one pass (a beam reorder).

        Every id of ``add`` must hold a reference before the swap (the same
        errors as the two calls apart).
        """
        add = add.reshape(-1).to(device="cpu", dtype=torch.int64)
        drop = drop.reshape(-1).to(device="cpu", dtype=torch.int64)
        self._check_range(torch.cat([add, drop]))
        if bool((self.refcount[add] <= 0).any()):
            bad = add[self.refcount[add] <= 0].unique().tolist()
            raise RuntimeError(f"incref of free blocks {bad[:8]}: they were never allocated")
        after = self.refcount.clone()
        after.index_add_(0, add, torch.ones_like(add))
        after.index_add_(0, drop, -torch.ones_like(drop))
        self._commit(after, drop)

    def _check_range(self, ids: torch.Tensor) -> None:
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.num_blocks):
            raise ValueError(
                f"block ids must be in [0, {self.num_blocks}); got min {int(ids.min())}, "
                f"max {int(ids.max())}"
            )

    def check_counts(self, expected: torch.Tensor) -> None:
        """Raise unless the counts equal ``expected`` and free blocks are exactly the zeros.

        Args:
            expected: ``(num_blocks,)`` references recounted from every block table.
        """
        if not torch.equal(self.refcount, expected.to(self.refcount.dtype)):
            diff = torch.nonzero(self.refcount != expected).flatten()[:8].tolist()
            raise RuntimeError(
                f"block refcounts disagree with the block tables at blocks {diff}: pool "
                f"{self.refcount[diff].tolist()}, tables {expected[diff].tolist()}"
            )
        free = torch.zeros(self.num_blocks, dtype=torch.bool)
        if self._free:
            free[torch.tensor(self._free)] = True
        if len(set(self._free)) != len(self._free) or not torch.equal(free, self.refcount == 0):
            raise RuntimeError("the free list and the zero refcounts disagree")
