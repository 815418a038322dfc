"""Per-layer block tables for a batch of rows (beams), with copy-on-write.

Every row of one layer has the same number of slots; row ``b``'s slot ``s``
lives at ``(blocks[b, s // bs], s % bs)``. After compaction a head keeps
``kept[b, h]`` tokens packed at the front; the uncompacted tail starts at the
block boundary ``tail_start`` (same for all rows)::

    slot     0        kept[b,h]     tail_start            num_slots
    row b    [ kept     | unused      | tail (new tokens)   ]

    beams after reorder(beam_idx=[0, 0, 2, 1]), block_size 4, 10 slots:
    row 0   [ 0 | 1 | 7 ]      blocks 0, 1 shared by all rows (refcount 4)
    row 1   [ 0 | 1 | 7 ]      block 7 shared by rows 0, 1 (refcount 2): the
    row 2   [ 0 | 1 | 9 ]      next write into it copies it first (2 slots),
    row 3   [ 0 | 1 | 8 ]      only one of the two rows pays that copy

A table never copies K/V on reorder: it permutes rows and moves reference
counts. All reference counting goes through :class:`BlockPool`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from lmcompact.hf.paged.blocks import BlockPool
from lmcompact.hf.paged.storage import KVStorage
from lmcompact.layout.paged import PagedLengths


def allocate_cleared(pool: BlockPool, storage: KVStorage, count: int) -> torch.Tensor:
    """``count`` new blocks from ``pool``, zeroed in ``storage``; ``(count,)`` int64 ids."""
    ids = pool.allocate(count)
    storage.clear(ids)
    return ids


@dataclass
class BlockTable:
    """Block ids and slot ranges of one layer.

    Attributes:
        blocks: ``(B, num_table_blocks)`` int64 CPU block ids; exactly the
            blocks that cover ``num_slots`` slots.
        kept: ``(B, Hkv)`` int64 kept tokens per head in slots ``[0, kept)``.
        tail_start: First slot of the uncompacted tail (multiple of block_size).
        num_slots: Slots in use per row.
        block_size: Slots per block.
    """

    blocks: torch.Tensor
    kept: torch.Tensor
    tail_start: int
    num_slots: int
    block_size: int
    _mirrors: dict[str, Any] = field(default_factory=dict, init=False, repr=False, compare=False)

    @classmethod
    def empty(cls, batch: int, num_kv_heads: int, block_size: int) -> BlockTable:
        return cls(
            blocks=torch.zeros(batch, 0, dtype=torch.int64),
            kept=torch.zeros(batch, num_kv_heads, dtype=torch.int64),
            tail_start=0,
            num_slots=0,
            block_size=block_size,
        )

    @property
    def batch_size(self) -> int:
        return int(self.blocks.shape[0])

    @property
    def num_kv_heads(self) -> int:
        return int(self.kept.shape[1])

    def lengths(self) -> PagedLengths:
        """The :class:`~lmcompact.layout.paged.PagedLengths` of this table (for the kernels)."""
        b = self.batch_size
        return PagedLengths(
            kept=self.kept.clone(),
            tail_start=torch.full((b,), self.tail_start, dtype=torch.int64),
            seq_len=torch.full((b,), self.num_slots, dtype=torch.int64),
        )

    @property
    def compacted(self) -> bool:
        """True once a policy packed the prompt (``kept`` / ``tail_start`` matter)."""
        return self.tail_start > 0

    def device_blocks(self, device: torch.device) -> torch.Tensor:
        """``blocks`` as int32 on ``device``, uploaded once per change (not per use).

        The copy is keyed on the tensor object: assigning ``blocks`` refreshes
        it; an in-place write must be followed by :meth:`invalidate_mirrors`
        (inference tensors have no version counter to detect it).
        """
        return _mirrored(self._mirrors, "blocks", self.blocks, device, torch.int32)

    def device_kept(self, device: torch.device) -> tuple[torch.Tensor, int]:
        """``kept`` on ``device`` (uploaded once per change) and its maximum (host int)."""
        kept = _mirrored(self._mirrors, "kept", self.kept, device, torch.int64)
        cached = self._mirrors.get("kept_max")
        if cached is None or cached[0] is not self.kept:
            cached = (self.kept, int(self.kept.max()) if self.kept.numel() else 0)
            self._mirrors["kept_max"] = cached
        return kept, cached[1]

    def invalidate_mirrors(self) -> None:
        """Forget the device copies (after writing ``blocks`` or ``kept`` in place)."""
        self._mirrors.clear()

    def visible(self, num_queries: int) -> torch.Tensor:
        """``(B, Hkv, S, num_slots)`` bool: slot visible to query ``i`` of row ``b``, head ``h``.

        Query ``i`` sits at slot ``num_slots - S + i``; it sees the kept slots of
        its head and the tail slots up to itself.
        """
        slots = torch.arange(self.num_slots)
        q_slot = torch.arange(self.num_slots - num_queries, self.num_slots)
        kept = slots.view(1, 1, 1, -1) < self.kept[:, :, None, None]
        tail = (slots.view(1, 1, -1) >= self.tail_start) & (
            slots.view(1, 1, -1) <= q_slot.view(1, -1, 1)
        )
        return kept | tail.unsqueeze(0)

    def addresses(self, row: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(block, offset)`` of ``slots`` of ``row``."""
        return self.blocks[row, slots // self.block_size], slots % self.block_size

    # ------------------------------------------------------------- mutation
    def append(self, count: int, pool: BlockPool, storage: KVStorage) -> torch.Tensor:
        """Make room for ``count`` new slots per row; return their ``(B, count)`` slot ids.

        A partly filled last block that other rows also hold is copied first
        (copy-on-write); new blocks come from ``pool``.
        """
        bs = self.block_size
        start = self.num_slots
        if start % bs and self.blocks.shape[1]:
            self._unshare_last(pool, storage, filled=start % bs)
        need = -(-(start + count) // bs) - self.blocks.shape[1]
        if need > 0:
            fresh = allocate_cleared(pool, storage, self.batch_size * need).view(
                self.batch_size, need
            )
            self.blocks = torch.cat([self.blocks, fresh], dim=1)
        self.num_slots = start + count
        return torch.arange(start, start + count).expand(self.batch_size, -1)

    def _unshare_last(self, pool: BlockPool, storage: KVStorage, filled: int) -> None:
        """Give each row a last block of its own (copy-on-write).

        Rows holding the same block copy it in row order until one reference is
        left, so the last such row (or a row outside this table) keeps it. The
        bookkeeping is a few host ints per row (cheaper than tensor ops at beam
        sizes); all copies go in one call. Whole blocks are copied: slots past
        ``filled`` hold finite values (zeroed at allocation, or stale after a
        crop) that attention never reads.
        """
        del filled  # whole blocks are copied (see above)
        last_ids = self.blocks[:, -1]
        last = last_ids.tolist()
        left = dict(zip(last, pool.refcount[last_ids].tolist(), strict=True))
        rows: list[int] = []
        for row, block in enumerate(last):
            if left[block] > 1:
                left[block] -= 1
                rows.append(row)
        if not rows:
            return
        copy_rows = torch.tensor(rows, dtype=torch.int64)
        src = last_ids[copy_rows]
        fresh = pool.allocate(len(rows))
        storage.copy_blocks(src, fresh, self.block_size)
        pool.decref(src)
        self.blocks[copy_rows, -1] = fresh
        self.invalidate_mirrors()

    def reorder(self, rows: torch.Tensor, pool: BlockPool) -> None:
        """Row ``b`` becomes old row ``rows[b]`` (beam search); blocks are shared, not copied."""
        rows = rows.to(device="cpu", dtype=torch.int64)
        if rows.shape != (self.batch_size,):
            raise ValueError(f"beam indices must be ({self.batch_size},), got {tuple(rows.shape)}")
        if torch.equal(rows, torch.arange(self.batch_size)):
            return
        self.select(rows, pool)

    @staticmethod
    def reorder_all(tables: list[BlockTable], rows: torch.Tensor, pool: BlockPool) -> None:
        """:meth:`reorder` every table by the same ``rows`` with one reference swap.

        What a beam step does to all layers of a cache: per-table bookkeeping
        is a row index, the counting is done once for all of them.
        """
        rows = rows.to(device="cpu", dtype=torch.int64)
        for table in tables:
            if rows.shape != (table.batch_size,):
                raise ValueError(
                    f"beam indices must be ({table.batch_size},), got {tuple(rows.shape)}"
                )
        if not tables or torch.equal(rows, torch.arange(rows.numel())):
            return
        new = [table.blocks[rows] for table in tables]
        pool.swap(
            torch.cat([b.reshape(-1) for b in new]),
            torch.cat([table.blocks.reshape(-1) for table in tables]),
        )
        for table, blocks in zip(tables, new, strict=True):
            table.blocks = blocks
            table.kept = table.kept[rows]

    def select(self, rows: torch.Tensor, pool: BlockPool) -> None:
        """Keep rows ``rows`` (any length, repeats allowed) as the new batch."""
        rows = rows.to(device="cpu", dtype=torch.int64)
        new_blocks = self.blocks[rows]
        pool.swap(new_blocks, self.blocks)
        self.blocks = new_blocks
        self.kept = self.kept[rows]

    def release(self, pool: BlockPool) -> None:
        """Drop every reference this table holds and empty it."""
        pool.decref(self.blocks)
        self.blocks = self.blocks[:, :0]
        self.kept = torch.zeros_like(self.kept)
        self.tail_start = 0
        self.num_slots = 0

    def truncate(self, num_slots: int, pool: BlockPool) -> None:
        """Drop slots past ``num_slots`` (tail only) and free blocks no longer covered."""
        if not self.tail_start <= num_slots <= self.num_slots:
            raise ValueError(
                f"can only cut the uncompacted tail: need {self.tail_start} <= num_slots <= "
                f"{self.num_slots}, got {num_slots}"
            )
        keep_blocks = -(-num_slots // self.block_size)
        pool.decref(self.blocks[:, keep_blocks:])
        self.blocks = self.blocks[:, :keep_blocks].clone()
        self.num_slots = num_slots


def _mirrored(
    cache: dict[str, Any], name: str, host: torch.Tensor, device: torch.device, dtype: torch.dtype
) -> torch.Tensor:
    """A device copy of ``host``, reused while ``host`` is the same object on ``device``."""
    cached = cache.get(name)
    if cached is None or cached[0] is not host or cached[1] != device:
        cached = (host, device, host.to(dtype=dtype).to(device, non_blocking=True).contiguous())
        cache[name] = cached
    return cached[2]
