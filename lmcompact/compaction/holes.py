"""Virtual block tables that skip a request's block-aligned hole (engine-free torch).

After a compacted load, a request's blocks hold the kept tokens packed first and a hole of
dropped-token blocks before the tokens vLLM computes itself. Logical positions (and RoPE)
stay those of the full prompt; attention alone reads a block table with the hole cut out::

    logical blocks   [ k0 k1 | h2 h3 h4 h5 | t6 t7 ]     seq_len = 8 * bs (+ partial)
    physical row     [ 11 12 | 13 14 15 16 | 17 18 ]
    virtual row      [ 11 12 | 17 18 | 0 0 0 0 ]          seq_len - 4 * bs

Because the hole lies before every query and causal masks are aligned bottom-right (the
last query sees the last key), shortening the key length by the hole keeps every query's
visible keys exactly "kept prefix + computed tokens up to itself".

Sliding-window layers: vLLM masks their window by *key index* in this virtual row, so a
key's index must equal its logical position minus a constant shared with the queries (the
hole). After the hole that holds (index = logical - hole). Before it, it holds only for
blocks whose packed tokens are the contiguous run ending where the hole starts: their
sliding layers keep the most recent tokens (``KeepPlan.with_recent``). Every block before
that run is cut out too, for sliding layers only (``Hole.window_lead``)::

    store load, 3 chunks  [ c0 | c1 | c2 | hole ...... | t6 t7 ]  c_i = last K of chunk i
    full layers           [ c0 | c1 | c2 | t6 t7 ]
    sliding layers        [ c2 | t6 t7 ]                 window_lead = 2 blocks

so every key a sliding layer sees sits at its logical distance from every query, and its
window mask is exact; it loses what lies before the lead (documented, never silent).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import torch

from lmcompact.compaction.host_copies import values_on_device


@dataclass(frozen=True)
class Hole:
    """One request's hole, in blocks, as the worker reads it from a step's metadata (the
    scheduler side's record is :class:`connectors.vllm.requests.HoleState`).

    Attributes:
        first_block: the physical block at column ``key_column`` of the request's block
            table row; identifies its batch row (the key of a step's holes).
        start_block: logical index of the first hole block.
        num_blocks: blocks in the hole.
        window_lead: leading blocks ``[0, window_lead)`` that sliding-window layers skip as
            well (``<= start_block``): those whose key index would not be the logical
            distance (see the module docstring). Full-attention layers ignore it.
        req_id: the request, for runners that know their batch rows by request id
            (:func:`cut_holes_in_place`); empty where only the first block is known.
        key_column: where ``first_block`` sits in the row: 0 (the request's first block)
            unless vLLM's prefix cache may share that block with another live request;
            then the row's last block in this step (the one holding its newest token: the
            request writes it and it is never hashed, so no other row holds it there). A
            row matches a key column > 0 only if that column is its last one, so a stale
            id another row still lists inside its own hole never matches.
    """

    first_block: int
    start_block: int
    num_blocks: int
    window_lead: int = 0
    req_id: str = ""
    key_column: int = 0

    def __post_init__(self) -> None:
        if self.start_block < 0 or self.num_blocks < 1:
            raise ValueError(f"a hole needs start_block >= 0 and num_blocks >= 1, got {self}")
        if not 0 <= self.window_lead <= self.start_block:
            raise ValueError(f"a hole needs 0 <= window_lead <= start_block, got {self}")
        if self.key_column < 0 or self.start_block <= self.key_column < self.stop_block:
            raise ValueError(f"a hole's key column must be >= 0 and outside it, got {self}")

    @property
    def stop_block(self) -> int:
        return self.start_block + self.num_blocks


def skip_holes(
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    num_reqs: int,
    holes: Mapping[int, Hole],
    block_size: int,
    sliding: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, list[int]] | None:
    """Cut holes out of the rows of requests that have one.

    Args:
        block_table: ``(rows, max_blocks)`` int32 physical block ids per batch row.
        seq_lens: ``(rows,)`` int32 key lengths (logical).
        num_reqs: rows in use (the rest is padding).
        holes: hole per row key (:attr:`Hole.first_block`, at :attr:`Hole.key_column`).
        block_size: tokens per block.
        sliding: the table serves sliding-window layers: also cut each hole's
            ``window_lead`` blocks (the row's column 0 then no longer is its first block).

    Returns:
        New ``(block_table, seq_lens, edited_rows)`` (fresh tensors; inputs untouched), or
        None when no row has a hole.
    """
    if not holes or num_reqs == 0:
        return None
    found = _rows_of(block_table, seq_lens, num_reqs, holes, block_size)
    if not found:
        return None
    table = block_table.clone()
    lens = seq_lens.clone()
    width = table.shape[1]
    rows = sorted(found)
    for r in rows:
        hole = found[r]
        s, n = hole.start_block, hole.num_blocks
        if s + n > width or int(lens[r]) <= (s + n) * block_size:
            raise ValueError(
                f"row {r}: hole blocks [{s}, {s + n}) need seq_len > {(s + n) * block_size} and "
                f"{s + n} block-table columns; got {int(lens[r])} and {width}"
            )
        lead = hole.window_lead if sliding else 0
        kept = torch.cat([block_table[r, lead:s], block_table[r, s + n :]])
        table[r, : kept.numel()] = kept
        table[r, kept.numel() :] = 0
        lens[r] -= (lead + n) * block_size
    return table, lens, rows


def last_column(seq_len: int, block_size: int) -> int:
    """Column of a row's last block for a key length of ``seq_len`` tokens."""
    return max(0, -(-seq_len // block_size) - 1)


def keyed_by_last_block(hole: Hole, row: Sequence[int], seq_len: int, block_size: int) -> Hole:
    """``hole`` keyed by the row's last block for a step whose key length is ``seq_len``
    (prefix caching: the row's first block may be shared with another live request)."""
    column = last_column(seq_len, block_size)
    return replace(hole, first_block=int(row[column]), key_column=column)


def _rows_of(
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    num_reqs: int,
    holes: Mapping[int, Hole],
    block_size: int,
) -> dict[int, Hole]:
    """Batch row -> its hole: the row whose column ``key_column`` holds the hole's key
    (for a column > 0, only if it is the row's last)."""
    columns = {hole.key_column for hole in holes.values()}
    width = block_table.shape[1]
    lasts = [last_column(int(n), block_size) for n in seq_lens[:num_reqs].tolist()]
    found: dict[int, Hole] = {}
    for column in sorted(c for c in columns if c < width):
        keys = block_table[:num_reqs, column].tolist()
        for r, key in enumerate(keys):
            hole = holes.get(key)
            if hole is None or hole.key_column != column:
                continue
            if column == 0 or lasts[r] == column:
                found[r] = hole
    return found


def skip_holes_on_device(
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    num_reqs: int,
    holes: Mapping[int, Hole],
    block_size: int,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """:func:`skip_holes` without reading the table back to the host (no synchronisation).

    Rows are matched to holes by their key block on the device (a sorted lookup of the
    holes' keys in each key column); every row shifts its columns from the hole's start left by the
    hole's length (rows without a hole shift by 0), and the key length shrinks by the hole.
    The per-row checks of :func:`skip_holes` are not made (they would need the host).

    Returns:
        New ``(block_table, seq_lens)`` or None when there are no holes or rows.
    """
    if not holes or num_reqs == 0:
        return None
    device = block_table.device
    rows, width = block_table.shape
    live = torch.arange(rows, device=device) < num_reqs
    lasts = ((seq_lens.to(torch.int64) + block_size - 1) // block_size - 1).clamp(min=0)
    start = torch.full((rows,), width, dtype=torch.int64, device=device)
    count = torch.zeros(rows, dtype=torch.int64, device=device)
    for column in sorted({hole.key_column for hole in holes.values()}):
        if column >= width:
            continue
        firsts = sorted(k for k, hole in holes.items() if hole.key_column == column)
        keys = values_on_device(firsts, block_table.dtype, device)
        spec = values_on_device(
            [[holes[f].start_block, holes[f].num_blocks] for f in firsts], torch.int64, device
        )
        first = block_table[:, column].contiguous()
        at = torch.searchsorted(keys, first).clamp(max=len(firsts) - 1)
        match = (keys[at] == first) & live
        if column > 0:
            match &= lasts == column
        start = torch.where(match, spec[at, 0], start)
        count = torch.where(match, spec[at, 1], count)
    cols = torch.arange(width, device=device).expand(rows, width)
    src = torch.where(cols >= start[:, None], cols + count[:, None], cols)
    moved = torch.gather(block_table, 1, src.clamp(max=width - 1))
    table = torch.where(src < width, moved, torch.zeros_like(moved))
    lens = seq_lens - (count * block_size).to(seq_lens.dtype)
    return table, lens


def cut_holes_in_place(
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    rows: list[int],
    starts: list[int],
    lengths: list[int] | torch.Tensor,
    block_size: int,
) -> None:
    """Cut holes out of known batch rows, editing the tensors in place.

    For runners that replay full CUDA graphs: the graphs read the table and key lengths
    from fixed buffers, so the cut must land in those buffers before the step's attention
    metadata is built from them. Rows are known on the host (by request id), so the cut
    needs no read-back: a few tiny host-to-device copies (page-locked: they do not wait for
    the previous step, :mod:`lmcompact.compaction.host_copies`) and three kernels.

    Args:
        block_table: ``(rows, max_blocks)`` int32 physical block ids (edited in place).
        seq_lens: ``(rows,)`` int32 key lengths (edited in place).
        rows: batch rows that have a hole (distinct).
        starts: per row, the logical index of its first hole block.
        lengths: per row, the hole's length in blocks (a device tensor when only the
            device knows it).
        block_size: tokens per block.
    """
    if not rows:
        return
    device = block_table.device
    index = values_on_device(rows, torch.int64, device)
    start = values_on_device(starts, torch.int64, device)
    if isinstance(lengths, torch.Tensor):
        count = lengths.to(device, torch.int64)
    else:
        count = values_on_device(lengths, torch.int64, device)
    width = block_table.shape[1]
    cols = torch.arange(width, device=device).expand(len(rows), width)
    src = torch.where(cols >= start[:, None], cols + count[:, None], cols)
    moved = torch.gather(block_table[index], 1, src.clamp(max=width - 1))
    block_table[index] = torch.where(src < width, moved, torch.zeros_like(moved))
    seq_lens.index_add_(0, index, (-count * block_size).to(seq_lens.dtype))


@dataclass
class HoleState:
    """One request's hole, in logical blocks of its row.

    Attributes:
        first_block: physical id of the request's block 0 (its batch-row key).
        start: logical index of the first hole block (>= 1).
        length: hole blocks (0 while none is open).
        visible_from: first step in which attention skips it and its blocks may go back.
        owned: False when the store half opened the hole (a compacted load); it is then
            only released, never grown.
        window_lead: leading blocks sliding-window layers skip as well (``<= start``).
    """

    first_block: int
    start: int
    length: int
    visible_from: int
    owned: bool = True
    window_lead: int = 0

    @property
    def stop(self) -> int:
        return self.start + self.length

    def wire(self, req_id: str) -> Hole:
        """The hole as the worker reads it (keyed by block 0; see :class:`Hole`)."""
        return Hole(self.first_block, self.start, self.length, self.window_lead, req_id)
