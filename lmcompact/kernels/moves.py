"""Token moves inside paged pools: what compaction and defragmentation copy.

A :class:`SlotMoves` lists, per segment (one request and kv head), source
slots and the first destination slot; the segment's tokens land in
consecutive destination slots, in order::

    segment s = (request r, head h), tokens cu[s]:cu[s+1]
    src_slots:  [ 3  7  8  12 ]              any slots of request r (sorted or not)
    dst slots:  [ d  d+1 d+2 d+3 ]  with d = dst_start[s]

Both the copy kernel and its torch reference consume this one description.
Planning (this module) is plain torch and runs wherever the tensors live.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lmcompact.layout.paged import PagedLengths


@dataclass(frozen=True)
class SlotMoves:
    """Per-segment token moves within or between paged pools.

    Attributes:
        src_slots: ``(M,)`` int64 source slot of every moved token.
        cu: ``(S + 1,)`` int64 segment offsets into ``src_slots``.
        request: ``(S,)`` int64 request (block-table row) of each segment.
        head: ``(S,)`` int64 kv head of each segment.
        dst_start: ``(S,)`` int64 destination slot of each segment's first token.
        max_count: Longest segment (a host int, so kernels need no device sync).
    """

    src_slots: torch.Tensor
    cu: torch.Tensor
    request: torch.Tensor
    head: torch.Tensor
    dst_start: torch.Tensor
    max_count: int

    def __post_init__(self) -> None:
        s = self.request.numel()
        for name in ("src_slots", "cu", "request", "head", "dst_start"):
            t = getattr(self, name)
            if t.dtype != torch.int64 or t.dim() != 1:
                raise ValueError(f"{name} must be a 1-D int64 tensor, got {t.dtype} {t.shape}")
        if self.cu.numel() != s + 1 or self.head.numel() != s or self.dst_start.numel() != s:
            raise ValueError(
                f"cu must have S + 1 = {s + 1} entries and head, dst_start S = {s}; got "
                f"{self.cu.numel()}, {self.head.numel()}, {self.dst_start.numel()}"
            )

    @property
    def num_tokens(self) -> int:
        return int(self.src_slots.numel())

    @property
    def num_segments(self) -> int:
        return int(self.request.numel())

    def token_segments(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(M,)`` segment of every token and its rank inside the segment."""
        counts = self.cu[1:] - self.cu[:-1]
        seg = torch.repeat_interleave(
            torch.arange(self.num_segments, device=self.cu.device),
            counts,
            output_size=self.num_tokens,
        )
        rank = torch.arange(self.num_tokens, device=self.cu.device) - self.cu[seg]
        return seg, rank


def compaction_moves(keep: Sequence[torch.Tensor], num_kv_heads: int) -> SlotMoves:
    """Moves that pack kept slots to the front: ``keep[b * Hkv + h]`` -> slots ``[0, n)``.

    Args:
        keep: ``B * Hkv`` int tensors of source slots to keep, in the order they
            should land (sorted keeps the original order; SnapKV-style plans are).
        num_kv_heads: Hkv.
    """
    if len(keep) % num_kv_heads:
        raise ValueError(f"need B * {num_kv_heads} index tensors, got {len(keep)}")
    device = keep[0].device if keep else torch.device("cpu")
    counts = [int(k.numel()) for k in keep]
    cu = torch.zeros(len(keep) + 1, dtype=torch.int64)
    cu[1:] = torch.cumsum(torch.tensor(counts, dtype=torch.int64), 0)
    segments = torch.arange(len(keep), dtype=torch.int64)
    src = torch.cat([k.to(torch.int64).to(device) for k in keep]) if keep else torch.empty(0)
    return SlotMoves(
        src_slots=src.to(torch.int64),
        cu=cu.to(device),
        request=(segments // num_kv_heads).to(device),
        head=(segments % num_kv_heads).to(device),
        dst_start=torch.zeros(len(keep), dtype=torch.int64, device=device),
        max_count=max(counts, default=0),
    )


@dataclass(frozen=True)
class DefragPlan:
    """Where each request's live tokens go when the pool is defragmented.

    Attributes:
        moves: The token moves (old table -> new table, same pool).
        block_table: ``(B, max_new_blocks)`` new block ids (unused entries 0).
        num_blocks: ``(B,)`` blocks each request holds after the move.
        lengths: New lengths: kept unchanged, the tail right after the kept
            region (block-aligned), no hole.
        blocks_before: Distinct blocks the requests held before (hole included).
        blocks_after: Blocks they use after.
        freed_blocks: Ids used before and free after (sorted).
    """

    moves: SlotMoves
    block_table: torch.Tensor
    num_blocks: torch.Tensor
    lengths: PagedLengths
    blocks_before: int
    blocks_after: int
    freed_blocks: torch.Tensor


def _held_blocks(table: torch.Tensor, lengths: PagedLengths, block_size: int) -> torch.Tensor:
    """Sorted distinct block ids the requests hold: their first ``ceil(seq_len / bs)`` entries.

    Hole entries count as held: a request that still holds its hole's blocks
    gets them back through the defragmentation.
    """
    ends = lengths.seq_len.tolist()
    used = [table[b, : -(-int(end) // block_size)] for b, end in enumerate(ends)]
    if not used:
        return torch.empty(0, dtype=torch.int64)
    return torch.unique(torch.cat(used).long().cpu())


def plan_defragment(
    block_table: torch.Tensor, lengths: PagedLengths, block_size: int
) -> DefragPlan:
    """Pack every request's live tokens into the lowest block ids of the pool.

    Before (bs = 4, request 0 kept 5 of 12 prefix tokens, 3 tail tokens)::

        table[0] = [9 4 7 | 2 ]        slots 0..4 kept, 5..11 hole, 12..14 tail
        blocks:    9: k k k k   4: k . . .   7: hole   2: t t t .

    After: request 0 holds ``[0 1 2]``, kept slots 0..4, tail at slot 8::

        blocks:    0: k k k k   1: k . . .   2: t t t .

    The new ids are handed out request after request from 0, so the free
    blocks form one range at the top of the pool (free-and-reallocate). A
    request holds the first ``ceil(seq_len / bs)`` entries of its table row,
    hole included; blocks referenced by no request count as free already.

    Args:
        block_table: ``(B, max_blocks)`` current block ids.
        lengths: current kept / tail_start / seq_len.
        block_size: Slots per block.
    """
    lengths.validate(lengths.num_kv_heads, block_table.shape[1] * block_size, block_size)
    device = block_table.device
    hkv = lengths.num_kv_heads
    kept = lengths.kept.long().cpu()
    start, end = lengths.tail_start.long().cpu(), lengths.seq_len.long().cpu()
    kept_max = kept.max(dim=1).values if kept.numel() else torch.zeros(0, dtype=torch.int64)
    new_tail = -(-kept_max // block_size) * block_size
    new_len = new_tail + (end - start)
    need = -(-new_len // block_size)
    first = torch.cumsum(need, 0) - need
    width = max(int(need.max()) if need.numel() else 0, 1)
    table = torch.zeros(len(need), width, dtype=torch.int64)
    for b, (f, n) in enumerate(zip(first.tolist(), need.tolist(), strict=True)):
        table[b, :n] = torch.arange(f, f + n)

    src: list[torch.Tensor] = []
    counts: list[int] = []
    request: list[int] = []
    heads: list[int] = []
    dst_start: list[int] = []
    for b in range(len(need)):
        tail = torch.arange(int(start[b]), int(end[b]))
        for h in range(hkv):
            for slots, dst in ((torch.arange(int(kept[b, h])), 0), (tail, int(new_tail[b]))):
                src.append(slots)
                counts.append(slots.numel())
                request.append(b)
                heads.append(h)
                dst_start.append(dst)
    cu = torch.zeros(len(counts) + 1, dtype=torch.int64)
    cu[1:] = torch.cumsum(torch.tensor(counts, dtype=torch.int64), 0)
    moves = SlotMoves(
        src_slots=(torch.cat(src) if src else torch.empty(0, dtype=torch.int64)).to(device),
        cu=cu.to(device),
        request=torch.tensor(request, dtype=torch.int64, device=device),
        head=torch.tensor(heads, dtype=torch.int64, device=device),
        dst_start=torch.tensor(dst_start, dtype=torch.int64, device=device),
        max_count=max(counts, default=0),
    )
    before = _held_blocks(block_table, lengths, block_size)
    after = torch.arange(int(need.sum()), dtype=torch.int64)
    freed = before[~torch.isin(before, after)]
    new_lengths = PagedLengths(
        kept=lengths.kept.clone(),
        tail_start=new_tail.to(lengths.tail_start.dtype).to(lengths.tail_start.device),
        seq_len=new_len.to(lengths.seq_len.dtype).to(lengths.seq_len.device),
    )
    return DefragPlan(
        moves=moves,
        block_table=table.to(block_table.dtype).to(device),
        num_blocks=need.to(device),
        lengths=new_lengths,
        blocks_before=int(before.numel()),
        blocks_after=int(after.numel()),
        freed_blocks=freed,
    )
