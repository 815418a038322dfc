"""Random compacted paged batches, for the kernel tests and ``lmcompact bench kernels``.

A case mimics what the connector holds after compaction: request ``b`` had a
prefix of ``prefix[b]`` tokens (block-aligned) of which head ``h`` kept
``kept[b][h]``, packed at the front; ``tail[b]`` tokens followed; the last
``q_len[b]`` of them are the queries. Blocks are handed out in a random order,
hole entries of the block table point at a poisoned block, and every slot
that holds no live token is poisoned too (NaN), so a kernel that reads a slot
it should skip produces NaN::

    table[b] = [ kept blocks | hole -> poison block | tail blocks ]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lmcompact.layout.paged import PagedLengths, cell_addresses, vllm_kv_views
from lmcompact.layout.ragged import RaggedLayer


@dataclass
class PagedCase:
    """One synthetic batch.

    Attributes:
        queries: ``(total_q, Hq, D)``.
        cache: The backing buffer (vLLM 0.26 ``(nb, Hkv, bs, 2D)`` or flash
            ``(2, nb, bs, Hkv, D)``).
        key_pool, value_pool: ``(nb, bs, Hkv, D)`` views of ``cache``.
        block_table: ``(B, max_blocks)`` int32.
        cu_seqlens_q: ``(B + 1,)`` int32.
        lengths: kept / tail_start / seq_len (int32).
        kept_positions: ``kept_positions[b][h]`` original positions (CPU int64) of
            the kept tokens, for the ragged cross-check.
    """

    queries: torch.Tensor
    cache: torch.Tensor
    key_pool: torch.Tensor
    value_pool: torch.Tensor
    block_table: torch.Tensor
    cu_seqlens_q: torch.Tensor
    lengths: PagedLengths
    kept_positions: list[list[torch.Tensor]]

    def attention_args(
        self,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, PagedLengths]:
        """The positional arguments of paged attention over this batch (queries, pools,
        block table, query offsets, lengths)."""
        return (
            self.queries,
            self.key_pool,
            self.value_pool,
            self.block_table,
            self.cu_seqlens_q,
            self.lengths,
        )

    def live_tokens(self) -> int:
        """Keys visible to each request's last query, summed over requests and heads."""
        return int(self.lengths.visible().sum())

    def to_ragged(self) -> tuple[RaggedLayer, torch.Tensor]:
        """The same K/V as a :class:`RaggedLayer` and ``(B, S)`` query positions.

        Needs equal ``q_len`` for every request (the ragged reference takes
        ``(B, Hq, S, D)`` queries).
        """
        bs = self.key_pool.shape[1]
        hkv = self.key_pool.shape[2]
        keys, values, positions, counts = [], [], [], []
        key_pool, value_pool = self.key_pool.cpu(), self.value_pool.cpu()
        table = self.block_table.cpu()
        for b in range(self.lengths.batch_size):
            start, end = int(self.lengths.tail_start[b]), int(self.lengths.seq_len[b])
            for h in range(hkv):
                kept = int(self.lengths.kept[b, h])
                slots = torch.cat([torch.arange(kept), torch.arange(start, end)])
                blocks = table[b].long()[slots // bs]
                keys.append(key_pool[blocks, slots % bs, h])
                values.append(value_pool[blocks, slots % bs, h])
                positions.append(torch.cat([self.kept_positions[b][h], torch.arange(start, end)]))
                counts.append(slots.numel())
        cu = torch.zeros(len(counts) + 1, dtype=torch.int64)
        cu[1:] = torch.cumsum(torch.tensor(counts), 0)
        layer = RaggedLayer(torch.cat(keys), torch.cat(values), torch.cat(positions), cu, hkv)
        q_lens = (self.cu_seqlens_q[1:] - self.cu_seqlens_q[:-1]).cpu()
        if q_lens.numel() and bool((q_lens != q_lens[0]).any()):
            raise ValueError("to_ragged needs the same q_len for every request")
        s = int(q_lens[0]) if q_lens.numel() else 0
        ends = self.lengths.seq_len.cpu().long()
        query_positions = ends[:, None] - s + torch.arange(s)[None, :]
        return layer, query_positions


def random_paged_case(
    kept: Sequence[Sequence[int]],
    prefix: Sequence[int],
    tail: Sequence[int],
    q_len: Sequence[int],
    *,
    group: int,
    head_dim: int,
    block_size: int,
    layout: str = "vllm",
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seed: int = 0,
    poison: bool = True,
) -> PagedCase:
    """Build a random compacted batch (see the module docstring).

    Args:
        kept: ``B x Hkv`` kept counts, each ``<= prefix[b]``.
        prefix: ``(B,)`` prefix lengths (multiples of ``block_size``; 0 allowed).
        tail: ``(B,)`` tokens after the prefix.
        q_len: ``(B,)`` queries per request, each ``<= tail[b]``.
        group: Query heads per kv head.
        head_dim: D.
        block_size: Slots per block.
        layout: ``"vllm"`` (vLLM 0.26 GPU cache) or ``"flash"``.
        dtype, device, seed: Data type, device and RNG seed.
        poison: Fill slots holding no live token with NaN.
    """
    batch = len(prefix)
    hkv = len(kept[0]) if kept else 0
    if len(kept) != batch or len(tail) != batch or len(q_len) != batch:
        raise ValueError("kept, prefix, tail and q_len must all have B entries")
    if layout not in ("vllm", "flash"):
        raise ValueError(f"layout must be 'vllm' or 'flash', got {layout!r}")
    for b in range(batch):
        if prefix[b] % block_size or max(kept[b]) > prefix[b] or q_len[b] > tail[b]:
            raise ValueError(
                f"request {b}: need prefix % block_size == 0, kept <= prefix, q_len <= tail"
            )
    gen = torch.Generator().manual_seed(seed)
    kept_blocks = [-(-max(k) // block_size) for k in kept]
    tail_blocks = [-(-t // block_size) for t in tail]
    width = max([p // block_size + t for p, t in zip(prefix, tail_blocks, strict=True)] + [1])
    live = sum(kept_blocks) + sum(tail_blocks)
    num_blocks = live + 1
    order = torch.randperm(num_blocks, generator=gen)
    poison_block = int(order[-1])
    table = torch.full((batch, width), poison_block, dtype=torch.int32)
    nxt = 0
    for b in range(batch):
        n = kept_blocks[b]
        table[b, :n] = order[nxt : nxt + n].to(torch.int32)
        nxt += n
        first = prefix[b] // block_size
        table[b, first : first + tail_blocks[b]] = order[nxt : nxt + tail_blocks[b]].to(torch.int32)
        nxt += tail_blocks[b]
    fill = float("nan") if poison else 0.0
    if layout == "vllm":
        cache = torch.full((num_blocks, hkv, block_size, 2 * head_dim), fill, dtype=dtype)
        k_pool, v_pool = vllm_kv_views(cache)
    else:
        cache = torch.full((2, num_blocks, block_size, hkv, head_dim), fill, dtype=dtype)
        k_pool, v_pool = cache[0], cache[1]
    positions: list[list[torch.Tensor]] = []
    for b in range(batch):
        positions.append([])
        tail_slots = torch.arange(prefix[b], prefix[b] + tail[b])
        for h in range(hkv):
            n = kept[b][h]
            chosen = torch.randperm(prefix[b], generator=gen)[:n].sort().values
            positions[b].append(chosen)
            slots = torch.cat([torch.arange(n), tail_slots])
            blocks = table[b].long()[slots // block_size]
            shape = (slots.numel(), head_dim)
            k_pool[blocks, slots % block_size, h] = torch.randn(shape, generator=gen).to(dtype)
            v_pool[blocks, slots % block_size, h] = torch.randn(shape, generator=gen).to(dtype)
    total_q = sum(q_len)
    queries = torch.randn(total_q, hkv * group, head_dim, generator=gen).to(dtype)
    cu = torch.zeros(batch + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(list(q_len), dtype=torch.int32), 0)
    prefix_t = torch.tensor(list(prefix), dtype=torch.int32)
    lengths = PagedLengths(
        kept=torch.tensor([list(k) for k in kept], dtype=torch.int32).reshape(batch, hkv),
        tail_start=prefix_t,
        seq_len=prefix_t + torch.tensor(list(tail), dtype=torch.int32),
    )
    cache = cache.to(device)
    if layout == "vllm":
        k_pool, v_pool = vllm_kv_views(cache)
    else:
        k_pool, v_pool = cache[0], cache[1]
    return PagedCase(
        queries=queries.to(device),
        cache=cache,
        key_pool=k_pool,
        value_pool=v_pool,
        block_table=table.to(device),
        cu_seqlens_q=cu.to(device),
        lengths=PagedLengths(
            lengths.kept.to(device), lengths.tail_start.to(device), lengths.seq_len.to(device)
        ),
        kept_positions=positions,
    )


def densify(case: PagedCase, base: int = 0, shrink: bool = False) -> PagedCase:
    """The same batch with every head's kept keys past slot ``base`` moved to dense cells.

    Each request's kept blocks after the first ``base`` slots are poisoned (NaN), then each
    head's keys ``[base, kept)`` are written head after head as cells
    (:mod:`lmcompact.layout.paged`), so attention over the result must equal attention over
    ``case``; a kernel that reads a cell it should not reads NaN.

    Args:
        case: a batch from :func:`random_paged_case` (block-aligned tail starts).
        base: leading slots every head keeps in place (block aligned, ``<= kept``).
        shrink: also move each request's tail up against its cells (the block table then
            skips the kept blocks the cells do not fill, and ``tail_start`` and ``seq_len``
            shrink with it), so a head's count may pass the tail start, as in the engine.
    """
    cache = case.cache.clone()
    key_pool, value_pool = vllm_kv_views(cache) if cache.dim() == 4 else (cache[0], cache[1])
    _, bs, hkv, _ = key_pool.shape
    lengths = case.lengths
    kept = lengths.kept.cpu().long()
    if base % bs or bool((kept < base).any()):
        raise ValueError(f"base {base} must be block aligned and at most every kept count")
    table = case.block_table
    starts = torch.zeros_like(kept)
    for b in range(kept.shape[0]):
        dense = kept[b] - base
        blocks = int(-(-int(kept[b].max()) // bs))
        row = table[b, base // bs : blocks].long()
        key_pool[row] = float("nan")
        value_pool[row] = float("nan")
        first = base * hkv
        for h in range(hkv):
            slots = torch.arange(base, int(kept[b, h]), device=table.device)
            old = table[b, slots // bs].long(), slots % bs
            cells = torch.arange(first, first + int(dense[h]), device=table.device)
            new = cell_addresses(table[b], cells, bs, hkv)
            key_pool[new] = case.key_pool[old[0], old[1], h]
            value_pool[new] = case.value_pool[old[0], old[1], h]
            starts[b, h] = first
            first += int(dense[h])
    device = lengths.kept.device
    tail_start, seq_len = lengths.tail_start, lengths.seq_len
    if shrink:
        table, tail_start, seq_len = _tail_after_cells(table, lengths, base, bs, hkv)
    return PagedCase(
        queries=case.queries,
        cache=cache,
        key_pool=key_pool,
        value_pool=value_pool,
        block_table=table,
        cu_seqlens_q=case.cu_seqlens_q,
        lengths=PagedLengths(
            lengths.kept,
            tail_start,
            seq_len,
            starts.to(device, lengths.kept.dtype).contiguous(),
            torch.full_like(lengths.tail_start, base),
        ),
        kept_positions=case.kept_positions,
    )


def _tail_after_cells(
    table: torch.Tensor, lengths: PagedLengths, base: int, bs: int, hkv: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Block table, tail starts and lengths with each request's tail blocks moved up to
    just after the blocks its dense cells fill."""
    rows = torch.zeros_like(table)
    tail_start = lengths.tail_start.clone()
    seq_len = lengths.seq_len.clone()
    for b in range(table.shape[0]):
        old = int(lengths.tail_start[b])
        if old % bs:
            raise ValueError(f"shrink needs block-aligned tail starts, got {old}")
        cells = int((lengths.kept[b].long() - base).sum())
        new = base + -(-cells // (bs * hkv)) * bs
        tail_blocks = -(-(int(lengths.seq_len[b]) - old) // bs)
        row = torch.cat([table[b, : new // bs], table[b, old // bs : old // bs + tail_blocks]])
        rows[b, : row.numel()] = row
        tail_start[b] = new
        seq_len[b] = int(lengths.seq_len[b]) - (old - new)
    return rows, tail_start, seq_len
