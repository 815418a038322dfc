"""Triton kernel that moves tokens between paged pools (compaction and defragmentation).

One program copies up to ``BLOCK_T`` tokens of one segment (request, kv head),
K and V, ``D`` contiguous elements each::

    grid = (segments, ceil(max_count / BLOCK_T))
    program (s, t):  rank = t * BLOCK_T + [0, BLOCK_T)
                     slot = src_slots[cu[s] + rank]      d = dst_start[s] + rank
                     src  = pool[src_table[r, slot // bs], slot % bs, h, :]
                     dst  = pool[dst_table[r, d // bs],    d % bs,    h, :]

When source and destination share storage the move is staged: first gathered
into a flat ``(M, D)`` buffer, then scattered, so overlapping moves never read a
slot another program already overwrote. Reference:
:func:`lmcompact.kernels.reference_paged.move_slots_reference`.
"""

from __future__ import annotations

import torch
import triton  # type: ignore[import-untyped]
import triton.language as tl  # type: ignore[import-untyped]

from lmcompact.kernels.moves import SlotMoves
from lmcompact.layout.paged import check_pool

BLOCK_T = 64


@triton.jit
def _move_slots_kernel(
    src_k,
    src_v,
    dst_k,
    dst_v,
    src_table,
    dst_table,
    src_slots,
    cu,
    request,
    head,
    dst_start,
    stride_sb,
    stride_ss,
    stride_sh,
    stride_db,
    stride_ds,
    stride_dh,
    stride_st,
    stride_dt,
    head_dim,
    SRC_BS: tl.constexpr,
    DST_BS: tl.constexpr,
    SRC_FLAT: tl.constexpr,
    DST_FLAT: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    seg = tl.program_id(0)
    tile = tl.program_id(1)
    lo = tl.load(cu + seg)
    count = tl.load(cu + seg + 1) - lo
    if tile * BLOCK_T < count:
        rank = tile * BLOCK_T + tl.arange(0, BLOCK_T)
        ok = rank < count
        token = (lo + rank).to(tl.int64)
        req = tl.load(request + seg).to(tl.int64)
        h = tl.load(head + seg).to(tl.int64)
        if SRC_FLAT:
            src_off = token * stride_sb
        else:
            slot = tl.load(src_slots + token, mask=ok, other=0).to(tl.int64)
            blk = tl.load(src_table + req * stride_st + slot // SRC_BS, mask=ok, other=0)
            src_off = blk.to(tl.int64) * stride_sb + (slot % SRC_BS) * stride_ss + h * stride_sh
        if DST_FLAT:
            dst_off = token * stride_db
        else:
            dslot = (tl.load(dst_start + seg) + rank).to(tl.int64)
            dblk = tl.load(dst_table + req * stride_dt + dslot // DST_BS, mask=ok, other=0)
            dst_off = dblk.to(tl.int64) * stride_db + (dslot % DST_BS) * stride_ds + h * stride_dh
        d = tl.arange(0, BLOCK_D)
        mask = ok[:, None] & (d < head_dim)[None, :]
        k = tl.load(src_k + src_off[:, None] + d[None, :], mask=mask)
        v = tl.load(src_v + src_off[:, None] + d[None, :], mask=mask)
        tl.store(dst_k + dst_off[:, None] + d[None, :], k, mask=mask)
        tl.store(dst_v + dst_off[:, None] + d[None, :], v, mask=mask)


def _check_table(table: torch.Tensor, name: str, device: torch.device) -> None:
    if table.dim() != 2 or table.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"{name} must be a 2-D int32/int64 tensor, got {table.dtype} {tuple(table.shape)}"
        )
    if table.stride(1) != 1 or table.device != device:
        raise ValueError(f"{name} must be row-contiguous and on {device}")


def _shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _launch(
    src: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int, int, int, int, bool],
    dst: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int, int, int, int, bool],
    moves: SlotMoves,
    head_dim: int,
) -> None:
    sk, sv, stab, ssb, sss, ssh, sbs, sflat = src
    dk, dv, dtab, dsb, dss, dsh, dbs, dflat = dst
    dummy = moves.cu
    grid = (moves.num_segments, triton.cdiv(moves.max_count, BLOCK_T))
    _move_slots_kernel[grid](
        sk,
        sv,
        dk,
        dv,
        dummy if stab is None else stab,
        dummy if dtab is None else dtab,
        moves.src_slots,
        moves.cu,
        moves.request,
        moves.head,
        moves.dst_start,
        ssb,
        sss,
        ssh,
        dsb,
        dss,
        dsh,
        0 if stab is None else stab.stride(0),
        0 if dtab is None else dtab.stride(0),
        head_dim,
        SRC_BS=sbs,
        DST_BS=dbs,
        SRC_FLAT=sflat,
        DST_FLAT=dflat,
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_T=BLOCK_T,
        num_warps=4,
    )


def move_slots(
    src_keys: torch.Tensor,
    src_values: torch.Tensor,
    src_table: torch.Tensor,
    dst_keys: torch.Tensor,
    dst_values: torch.Tensor,
    dst_table: torch.Tensor,
    moves: SlotMoves,
) -> None:
    """Copy tokens as ``moves`` says, K and V, on the GPU (staged when pools alias).

    Args:
        src_keys, src_values: ``(num_blocks, block_size, Hkv, D)`` source pool views.
        src_table: ``(B, max_blocks)`` source block ids per request.
        dst_keys, dst_values: destination pool views (may be the source pool).
        dst_table: ``(B, max_blocks')`` destination block ids per request.
        moves: segments of (request, head) with source slots and destination start.
    """
    _, sbs, shkv, d = check_pool(src_keys, src_values)
    _, dbs, dhkv, dd = check_pool(dst_keys, dst_values)
    if (shkv, d) != (dhkv, dd) or src_keys.dtype != dst_keys.dtype:
        raise ValueError(
            f"source and destination pools differ: heads {shkv} vs {dhkv}, head_dim {d} vs "
            f"{dd}, dtype {src_keys.dtype} vs {dst_keys.dtype}"
        )
    device = src_keys.device
    _check_table(src_table, "src_table", device)
    _check_table(dst_table, "dst_table", device)
    for name in ("src_slots", "cu", "request", "head", "dst_start"):
        if getattr(moves, name).device != device:
            raise ValueError(f"moves.{name} must be on {device}")
    if moves.num_tokens == 0 or moves.max_count == 0:
        return
    src = (src_keys, src_values, src_table, *src_keys.stride()[:3], sbs, False)
    dst = (dst_keys, dst_values, dst_table, *dst_keys.stride()[:3], dbs, False)
    aliased = _shares_storage(src_keys, dst_keys) or _shares_storage(src_values, dst_values)
    if not aliased:
        _launch(src, dst, moves, d)  # type: ignore[arg-type]
        return
    stage_k = torch.empty(moves.num_tokens, d, dtype=src_keys.dtype, device=device)
    stage_v = torch.empty_like(stage_k)
    flat = (stage_k, stage_v, None, d, 0, 0, 1, True)
    _launch(src, flat, moves, d)  # type: ignore[arg-type]
    _launch(flat, dst, moves, d)  # type: ignore[arg-type]
