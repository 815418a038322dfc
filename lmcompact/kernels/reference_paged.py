"""Torch references for the paged kernels: per-head paged attention and slot moves.

These run anywhere (CPU included) and are what ``tests/gpu`` compares the
Triton kernels with. They loop over requests and heads and favour clarity over
speed. Slot ranges follow :mod:`lmcompact.layout.paged`::

    slot  0          kept[b, h]     tail_start[b]          seq_len[b]
          [ kept       | hole         | tail (causal)        ]
"""

from __future__ import annotations

import math

import torch

from lmcompact.kernels.moves import SlotMoves
from lmcompact.layout.paged import PagedLengths, cell_addresses, check_pool


def check_queries(
    queries: torch.Tensor, cu_seqlens_q: torch.Tensor, num_kv_heads: int, head_dim: int
) -> tuple[int, int]:
    """Validate flat varlen queries ``(total_q, Hq, D)``; return ``(batch, group)``."""
    if queries.dim() != 3 or queries.shape[2] != head_dim:
        raise ValueError(
            f"queries must be (total_q, q_heads, head_dim={head_dim}), got {tuple(queries.shape)}"
        )
    if queries.shape[1] % num_kv_heads:
        raise ValueError(
            f"q_heads ({queries.shape[1]}) must be a multiple of kv heads ({num_kv_heads})"
        )
    if cu_seqlens_q.dim() != 1 or cu_seqlens_q.numel() < 2:
        raise ValueError(f"cu_seqlens_q must be (B + 1,), got {tuple(cu_seqlens_q.shape)}")
    if cu_seqlens_q.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"cu_seqlens_q must be int32 or int64, got {cu_seqlens_q.dtype}")
    return cu_seqlens_q.numel() - 1, queries.shape[1] // num_kv_heads


def visible_slots(lengths: PagedLengths, batch: int, head: int) -> torch.Tensor:
    """Slots a request's head attends to: ``[0, kept) ++ [tail_start, seq_len)``."""
    kept = int(lengths.kept[batch, head])
    start, end = int(lengths.tail_start[batch]), int(lengths.seq_len[batch])
    device = lengths.kept.device
    return torch.cat([torch.arange(kept, device=device), torch.arange(start, end, device=device)])


def key_addresses(
    lengths: PagedLengths, table_row: torch.Tensor, batch: int, head: int, block_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Visible slots of one request's head and the pool ``(block, slot, head)`` holding each.

    Kept keys sit at their slots, or past ``dense_base`` in the head's dense cells
    (:mod:`lmcompact.layout.paged`); tail keys at their slots.
    """
    slots = visible_slots(lengths, batch, head).to(table_row.device)
    heads = torch.full_like(slots, head)
    if lengths.dense_start is None or lengths.dense_base is None:
        return slots, table_row[slots // block_size].long(), slots % block_size, heads
    # a head may keep more keys than the cells' slots: only its cells give their addresses
    base, kept = int(lengths.dense_base[batch]), int(lengths.kept[batch, head])
    at_slot = torch.ones_like(slots, dtype=torch.bool)
    at_slot[base:kept] = False
    blocks = torch.zeros_like(slots)
    offsets = torch.zeros_like(slots)
    blocks[at_slot] = table_row[slots[at_slot] // block_size].long()
    offsets[at_slot] = slots[at_slot] % block_size
    first = int(lengths.dense_start[batch, head])
    cells = torch.arange(first, first + kept - base, device=table_row.device)
    blocks[base:kept], offsets[base:kept], heads[base:kept] = cell_addresses(
        table_row, cells, block_size, lengths.num_kv_heads
    )
    return slots, blocks, offsets, heads


def paged_attention_reference(
    queries: torch.Tensor,
    key_pool: torch.Tensor,
    value_pool: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    lengths: PagedLengths,
    *,
    scale: float | None = None,
    return_key_mass: bool = False,
    key_scales: torch.Tensor | None = None,
    value_scales: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention of varlen queries over a compacted paged pool, per kv head.

    Args:
        queries: ``(total_q, Hq, D)``; request ``b`` owns rows
            ``cu_seqlens_q[b]:cu_seqlens_q[b+1]``, its last tail tokens.
        key_pool: ``(num_blocks, block_size, Hkv, D)`` view (any strides).
        value_pool: same shape as ``key_pool``.
        block_table: ``(B, max_blocks)`` int block ids per request.
        cu_seqlens_q: ``(B + 1,)`` query offsets.
        lengths: kept / tail_start / seq_len per request and head.
        scale: Softmax scale (default ``1 / sqrt(D)``).
        return_key_mass: Also return the attention mass per key slot.
        key_scales, value_scales: ``(num_blocks, block_size, Hkv)`` float32
            per-token scales of an int8 pool (K/V = int8 value x scale), or None.

    Returns:
        ``(total_q, Hq, D)`` output in the queries' dtype (zeros for a query that
        sees no key) and, if asked, ``(B, Hkv, max_blocks * block_size)`` float32
        mass per slot: summed over the request's queries, averaged over the query
        heads of the kv group; zero on slots nobody sees.
    """
    _, bs, hkv, d = check_pool(key_pool, value_pool)
    batch, group = check_queries(queries, cu_seqlens_q, hkv, d)
    lengths.validate(hkv, block_table.shape[1] * bs, bs)
    if return_key_mass and lengths.dense:
        raise ValueError("key mass per slot is undefined for dense per-head cells")
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    out = torch.zeros_like(queries)
    mass = (
        torch.zeros(batch, hkv, block_table.shape[1] * bs, device=queries.device)
        if return_key_mass
        else None
    )
    cu = cu_seqlens_q.tolist()
    for b in range(batch):
        q_len = cu[b + 1] - cu[b]
        seq_len = int(lengths.seq_len[b])
        if q_len == 0:
            continue
        q_slot = torch.arange(seq_len - q_len, seq_len, device=queries.device)
        for h in range(hkv):
            slots, blocks, offsets, heads = key_addresses(lengths, block_table[b], b, h, bs)
            k = key_pool[blocks, offsets, heads].float()  # (n, D)
            v = value_pool[blocks, offsets, heads].float()
            if key_scales is not None and value_scales is not None:
                k = k * key_scales[blocks, offsets, heads].float()[:, None]
                v = v * value_scales[blocks, offsets, heads].float()[:, None]
            q = queries[cu[b] : cu[b + 1], h * group : (h + 1) * group].float()  # (S, G, D)
            logits = torch.einsum("sgd,nd->sgn", q, k) * scale
            kept = int(lengths.kept[b, h])
            always = torch.arange(slots.numel(), device=slots.device) < kept  # the kept keys
            seen = always[None, :] | (slots[None, :] <= q_slot[:, None])  # (S, n)
            logits = logits.masked_fill(~seen[:, None, :], float("-inf"))
            probs = torch.softmax(logits, dim=-1).nan_to_num(0.0)
            out[cu[b] : cu[b + 1], h * group : (h + 1) * group] = torch.einsum(
                "sgn,nd->sgd", probs, v
            ).to(queries.dtype)
            if mass is not None:
                mass[b, h, slots] = probs.sum(dim=0).mean(dim=0)
    return out, mass


def move_slots_reference(
    src_keys: torch.Tensor,
    src_values: torch.Tensor,
    src_table: torch.Tensor,
    dst_keys: torch.Tensor,
    dst_values: torch.Tensor,
    dst_table: torch.Tensor,
    moves: SlotMoves,
) -> None:
    """Copy tokens between paged pools as ``moves`` says (reads all before writing).

    Source and destination may be the same pool: every moved token is gathered
    first, then scattered, so overlapping moves are safe.
    """
    _, sbs, _, _ = check_pool(src_keys, src_values)
    _, dbs, _, _ = check_pool(dst_keys, dst_values)
    seg, rank = moves.token_segments()
    request = moves.request[seg]
    head = moves.head[seg]
    src = moves.src_slots
    dst = moves.dst_start[seg] + rank
    sb, so = src_table[request, src // sbs].long(), src % sbs
    db, do = dst_table[request, dst // dbs].long(), dst % dbs
    k = src_keys[sb, so, head].clone()
    v = src_values[sb, so, head].clone()
    dst_keys[db, do, head] = k.to(dst_keys.dtype)
    dst_values[db, do, head] = v.to(dst_values.dtype)
