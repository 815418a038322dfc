"""One decode step for every layer at once: host bookkeeping, then one upload.

A decode step appends one token to every row of every layer. The host work is
done once per step for all layers, not once per layer: copy-on-write of
shared last blocks and new blocks come from one pool call, their K/V copies
and clears are one device call each, and the block tables, write addresses
and lengths of all layers go to the device in one copy into fixed buffers::

    host, once per step     append_token(): COW, new blocks, lengths
                            DecodeState.fill(): (L, B, W) tables, write slots,
                            kept / tail_start / seq_len  ->  one H2D copy
    device, per layer       write K/V at (write_block[l, b], write_offset[l, b])
                            paged_decode_attention(tables[l], lengths(l), ...)

The device buffers keep their addresses from step to step and the decode
kernel reads every length from them, so a CUDA graph of the model's decode
forward (:mod:`lmcompact.hf.paged.graph`) replays correctly at every later
step. Host index tensors go to the device with ``non_blocking=True`` (from
pageable memory that stages the bytes and returns, without the stream sync a
blocking copy makes).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from lmcompact.hf.paged.blocks import BlockPool
from lmcompact.hf.paged.storage import KVStorage
from lmcompact.hf.paged.table import BlockTable
from lmcompact.layout.paged import PagedLengths

logger = logging.getLogger(__name__)

WIDTH_HEADROOM = 512
"""Token slots of room a new state leaves past the current length (then it is rebuilt)."""


def append_token(tables: list[BlockTable], pool: BlockPool, storage: KVStorage) -> None:
    """One new slot in every row of every table: :meth:`BlockTable.append` (1) for all at once.

    A table whose rows end on a block boundary gets a new column of blocks; a
    table whose last block is partly filled gives every row that shares it
    with another holder its own copy (the same rule as
    :meth:`BlockTable._unshare_last`: rows in order copy until one reference
    is left). All blocks come from one :meth:`BlockPool.allocate`; the copies
    are one :meth:`KVStorage.copy_blocks` and the new blocks one
    :meth:`KVStorage.clear`.
    """
    if not tables:
        return
    bs = tables[0].block_size
    grow = [t for t in tables if t.num_slots % bs == 0]
    partial = [t for t in tables if t.num_slots % bs]
    copies: list[tuple[BlockTable, list[int]]] = []
    sources: list[int] = []
    if partial:
        last = torch.stack([t.blocks[:, -1] for t in partial])  # (n, B)
        counts = pool.refcount[last].tolist()
        for table, ids, refs in zip(partial, last.tolist(), counts, strict=True):
            left = dict(zip(ids, refs, strict=True))
            rows = []
            for row, block in enumerate(ids):
                if left[block] > 1:
                    left[block] -= 1
                    rows.append(row)
            if rows:
                copies.append((table, rows))
                sources.extend(ids[row] for row in rows)
    new_count = sum(t.batch_size for t in grow)
    fresh = pool.allocate(len(sources) + new_count)
    if sources:
        src = torch.tensor(sources, dtype=torch.int64)
        dst = fresh[: len(sources)]
        storage.copy_blocks(src, dst, bs)
        pool.decref(src)
        offset = 0
        for table, rows in copies:
            table.blocks[rows, -1] = dst[offset : offset + len(rows)]
            table.invalidate_mirrors()
            offset += len(rows)
    if new_count:
        new = fresh[len(sources) :]
        storage.clear(new)
        offset = 0
        for table in grow:
            column = new[offset : offset + table.batch_size].view(-1, 1)
            table.blocks = torch.cat([table.blocks, column], dim=1)
            offset += table.batch_size
    for table in tables:
        table.num_slots += 1


@dataclass
class DecodeState:
    """Device buffers one decode step reads, for all ``L`` layers of a cache.

    All views below are slices of one int64 buffer (and of its pinned host
    twin on CUDA; on the CPU both are the same tensor).

    Attributes:
        tables: ``(L, B, W)`` block ids (columns past a row's length are stale).
        write_block: ``(L, B)`` block of the slot the step's token goes to.
        write_offset: ``(L, B)`` that slot's offset in its block.
        kept: ``(L, B, Hkv)`` kept prompt tokens per head.
        tail_start: ``(L, B)`` first tail slot; seq_len: ``(L, B)`` slots in use.
        cu_seqlens_q: ``(B + 1,)`` ``0, 1, ..., B`` (one query per row).
        num_splits: Key splits of the decode kernel (fixed for the state's life).
    """

    num_layers: int
    batch: int
    num_kv_heads: int
    width: int
    device: torch.device
    num_splits: int
    host: torch.Tensor = field(repr=False)
    buffer: torch.Tensor = field(repr=False)
    _event: torch.cuda.Event | None = field(default=None, repr=False)
    _lengths: list[PagedLengths] = field(default_factory=list, repr=False)
    _host_views: tuple[torch.Tensor, ...] = field(default=(), repr=False)
    _device_views: tuple[torch.Tensor, ...] = field(default=(), repr=False)

    @classmethod
    def build(
        cls,
        num_layers: int,
        batch: int,
        num_kv_heads: int,
        width: int,
        device: torch.device,
        num_splits: int,
    ) -> DecodeState:
        size = cls._size(num_layers, batch, num_kv_heads, width)
        if device.type == "cuda":
            host = torch.zeros(size, dtype=torch.int64, pin_memory=True)
            buffer = torch.zeros(size, dtype=torch.int64, device=device)
        else:
            host = buffer = torch.zeros(size, dtype=torch.int64, device=device)
        state = cls(num_layers, batch, num_kv_heads, width, device, num_splits, host, buffer)
        state._host_views = state._views(host)
        state._device_views = views = state._views(buffer)
        state._host_views[-1].copy_(torch.arange(batch + 1))
        buffer.copy_(host)
        state._lengths = [
            PagedLengths(views[3][i], views[4][i], views[5][i]) for i in range(num_layers)
        ]
        logger.debug(
            "decode state: %d layers x %d rows x %d table columns on %s, %d key splits",
            num_layers,
            batch,
            width,
            device,
            num_splits,
        )
        return state

    @staticmethod
    def _size(layers: int, batch: int, heads: int, width: int) -> int:
        return layers * batch * (width + 4 + heads) + batch + 1

    def _views(self, flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        lay, b, h, w = self.num_layers, self.batch, self.num_kv_heads, self.width
        sizes = [lay * b * w, lay * b, lay * b, lay * b * h, lay * b, lay * b, b + 1]
        parts = torch.split(flat, sizes)
        shapes = [(lay, b, w), (lay, b), (lay, b), (lay, b, h), (lay, b), (lay, b), (b + 1,)]
        return tuple(p.view(s) for p, s in zip(parts, shapes, strict=True))

    def fits(self, layers: int, batch: int, heads: int, columns: int, device: torch.device) -> bool:
        """Whether this state serves a cache of this shape with ``columns`` table columns."""
        same = (layers, batch, heads) == (self.num_layers, self.batch, self.num_kv_heads)
        return same and device == self.device and columns <= self.width

    # ------------------------------------------------------------ device side
    @property
    def tables(self) -> torch.Tensor:
        return self._device_views[0]

    @property
    def write_block(self) -> torch.Tensor:
        return self._device_views[1]

    @property
    def write_offset(self) -> torch.Tensor:
        return self._device_views[2]

    @property
    def cu_seqlens_q(self) -> torch.Tensor:
        return self._device_views[6]

    def lengths(self, layer: int) -> PagedLengths:
        """Layer ``layer``'s kept / tail_start / seq_len views on the device."""
        return self._lengths[layer]

    # -------------------------------------------------------------- host side
    def fill(self, tables: list[BlockTable]) -> None:
        """Write every layer's table and lengths into the host buffer and upload it (one copy)."""
        if self._event is not None:
            self._event.synchronize()  # the last upload has read the pinned buffer
        blocks, wblock, woff, kept, tail, seq, _ = self._host_views
        bs = tables[0].block_size
        slots = [t.num_slots for t in tables]
        columns = [t.blocks.shape[1] for t in tables]
        if len(set(columns)) == 1:
            stacked = torch.stack([t.blocks for t in tables])
            blocks[:, :, : columns[0]] = stacked
        else:
            for i, t in enumerate(tables):
                blocks[i, :, : columns[i]] = t.blocks
        kept.copy_(torch.stack([t.kept for t in tables]))
        last = torch.tensor(slots, dtype=torch.int64) - 1
        column = (last // bs).view(-1, 1, 1).expand(-1, self.batch, 1)
        wblock.copy_(blocks.gather(2, column).squeeze(2))
        woff.copy_((last % bs).view(-1, 1).expand(-1, self.batch))
        tail.copy_(torch.tensor([t.tail_start for t in tables]).view(-1, 1).expand(-1, self.batch))
        seq.copy_(torch.tensor(slots).view(-1, 1).expand(-1, self.batch))
        if self.host is not self.buffer:
            self.buffer.copy_(self.host, non_blocking=True)
            if self._event is None:
                self._event = torch.cuda.Event()
            self._event.record()
