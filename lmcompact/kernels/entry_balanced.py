"""The per-head launch with its key splits balanced across heads (Triton device code).

:func:`lmcompact.kernels.entry_attention.attend_entries` splits each head's visible keys into
``S`` parts, so a head with three times the mean count (kvzip's ``per_head.slack`` 3 allows
it) makes its programs three times longer than the others', and the launch waits for them.
Here the ``Hkv x S`` programs of a request's query tile split the heads' visible keys laid
end to end instead::

    heads    [ h0: n0 keys | h1: n1 keys | ... ]          total = sum of n_h
    program p of Hkv x S  takes keys [p x chunk, (p + 1) x chunk) of that line, chunk =
             total / (Hkv x S) rounded up to whole key tiles, one online softmax per head
             it crosses, each written as partial slot ``p + h``

A head's partials sit in consecutive slots (heads are laid out in order, so ``p + h`` never
repeats), ``(Hkv x S + Hkv, T, group, D)`` floats in all, and :func:`merge_balanced_kernel`
merges each head's own. Everything is derived on the device from the same tables, so the
grid is fixed (CUDA-graph safe). Only the entry lookup over dense cells (bf16/fp16 pages)
takes this path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton  # type: ignore[import-untyped]
import triton.language as tl  # type: ignore[import-untyped]

from lmcompact.kernels.paged_attention_kernels import LOG2E, _attend_span, _row_entry

if TYPE_CHECKING:
    from lmcompact.kernels.entry_attention import EntryLengths


@triton.jit
def _tile_line(
    kept_ptr, tail_ptr, seq_ptr, cu_q_ptr, e, b, pid_m, HKV, GROUP, BLOCK_M, BLOCK_N, NUM_SPLITS
):
    """A query tile's shared lengths: its query run, the tail keys its last query sees past
    each head's kept ones (``reach``) and the heads' visible keys end to end (``total``)."""
    q_lo = tl.load(cu_q_ptr + b).to(tl.int32)
    q_len = tl.load(cu_q_ptr + b + 1).to(tl.int32) - q_lo
    tail = tl.load(tail_ptr + e).to(tl.int32)
    seq = tl.load(seq_ptr + b).to(tl.int32)
    last_q = tl.minimum(q_len - 1, (pid_m * BLOCK_M + BLOCK_M - 1) // GROUP)
    reach = seq - q_len + last_q - tail + 1
    total = 0
    for hh in tl.static_range(HKV):
        total += tl.maximum(tl.load(kept_ptr + e * HKV + hh).to(tl.int32) + reach, 0)
    # each of the Hkv x S programs' share of that line, in whole key tiles
    chunk = tl.cdiv(tl.cdiv(tl.maximum(total, 1), HKV * NUM_SPLITS), BLOCK_N) * BLOCK_N
    return q_lo, q_len, tail, seq, reach, total, chunk


@triton.jit
def attn_balanced_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    table_ptr,
    cu_q_ptr,
    kept_ptr,
    tail_ptr,
    seq_ptr,
    dense_start_ptr,
    dense_base_ptr,
    entry_ptr,
    part_ptr,
    part_lse_ptr,
    scale_log2,
    head_dim,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_tb,
    stride_ps,
    stride_pt,
    stride_pg,
    stride_ls,
    stride_lt,
    HKV: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    pid_bh = tl.program_id(0)
    pid_m = tl.program_id(1)
    b = pid_bh // HKV
    p = (pid_bh % HKV) * NUM_SPLITS + tl.program_id(2)
    e = _row_entry(table_ptr, entry_ptr, b, stride_tb, True)
    n_rows = (tl.load(cu_q_ptr + b + 1).to(tl.int32) - tl.load(cu_q_ptr + b).to(tl.int32)) * GROUP
    if (pid_m * BLOCK_M < n_rows) & (e >= 0):
        q_lo, q_len, tail, seq, reach, total, chunk = _tile_line(
            kept_ptr,
            tail_ptr,
            seq_ptr,
            cu_q_ptr,
            e,
            b,
            pid_m,
            HKV,
            GROUP,
            BLOCK_M,
            BLOCK_N,
            NUM_SPLITS,
        )
        g_lo = p * chunk
        g_hi = tl.minimum(g_lo + chunk, total)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < n_rows
        qi = rows // GROUP
        g = rows % GROUP
        q_slot = seq - q_len + qi
        d = tl.arange(0, BLOCK_D)
        d_ok = d < head_dim
        row_base = table_ptr + b.to(tl.int64) * stride_tb
        base = tl.load(dense_base_ptr + e).to(tl.int32)
        token = (q_lo + qi).to(tl.int64)
        offset = total * 0
        for hh in range(HKV):  # a loop, not unrolled: one copy of the key loop
            kept = tl.load(kept_ptr + e * HKV + hh).to(tl.int32)
            visible = tl.maximum(kept + reach, 0)
            lo = tl.maximum(g_lo - offset, 0)
            hi = tl.minimum(g_hi - offset, visible)
            if lo < hi:
                q_off = token * stride_qt + (hh * GROUP + g) * stride_qh
                q = tl.load(
                    q_ptr + q_off[:, None] + d[None, :],
                    mask=row_ok[:, None] & d_ok[None, :],
                    other=0.0,
                )
                m_i, l_i, acc = _attend_span(
                    q,
                    tl.full([BLOCK_M], float("-inf"), tl.float32),
                    tl.zeros([BLOCK_M], tl.float32),
                    tl.zeros([BLOCK_M, BLOCK_D], tl.float32),
                    lo,
                    hi,
                    kept,
                    tail,
                    q_slot,
                    base,
                    tl.load(dense_start_ptr + e * HKV + hh).to(tl.int32),
                    hh,
                    row_base,
                    k_ptr,
                    v_ptr,
                    k_ptr,  # scale pointers: unused (no int8 pages here)
                    v_ptr,
                    d,
                    d_ok,
                    scale_log2,
                    stride_kb,
                    stride_ks,
                    stride_kh,
                    0,
                    0,
                    0,
                    HKV,
                    BLOCK_SIZE,
                    BLOCK_N,
                    DOT_PRECISION,
                    False,
                    True,
                )
                has = l_i > 0.0
                out = acc / tl.where(has, l_i, 1.0)[:, None]
                lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
                slot = (p + hh).to(tl.int64)
                o_off = slot * stride_ps + token * stride_pt + g * stride_pg
                o_mask = row_ok[:, None] & d_ok[None, :]
                tl.store(part_ptr + o_off[:, None] + d[None, :], out, mask=o_mask)
                tl.store(part_lse_ptr + slot * stride_ls + token * stride_lt + g, lse, mask=row_ok)
            offset += visible


@triton.jit
def merge_balanced_kernel(
    part_ptr,
    part_lse_ptr,
    out_ptr,
    table_ptr,
    entry_ptr,
    cu_q_ptr,
    kept_ptr,
    tail_ptr,
    seq_ptr,
    head_dim,
    stride_ps,
    stride_pt,
    stride_pg,
    stride_ls,
    stride_lt,
    stride_ot,
    stride_oh,
    stride_tb,
    HKV: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    """Merge head ``h``'s partial slots (those of the programs whose keys crossed it) into
    ``out``'s rows of the tile; rows of requests without an entry are left alone."""
    pid_bh = tl.program_id(0)
    pid_m = tl.program_id(1)
    b = pid_bh // HKV
    h = pid_bh % HKV
    e = _row_entry(table_ptr, entry_ptr, b, stride_tb, True)
    n_rows = (tl.load(cu_q_ptr + b + 1).to(tl.int32) - tl.load(cu_q_ptr + b).to(tl.int32)) * GROUP
    if (pid_m * BLOCK_M < n_rows) & (e >= 0):
        q_lo, _, _, _, reach, _, chunk = _tile_line(
            kept_ptr,
            tail_ptr,
            seq_ptr,
            cu_q_ptr,
            e,
            b,
            pid_m,
            HKV,
            GROUP,
            BLOCK_M,
            BLOCK_N,
            NUM_SPLITS,
        )
        offset = reach * 0
        for hh in tl.static_range(HKV):
            if hh < h:
                offset += tl.maximum(tl.load(kept_ptr + e * HKV + hh).to(tl.int32) + reach, 0)
        visible = tl.maximum(tl.load(kept_ptr + e * HKV + h).to(tl.int32) + reach, 0)
        first = offset // chunk
        last = (offset + visible - 1) // chunk
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < n_rows
        token = (q_lo + rows // GROUP).to(tl.int64)
        g = rows % GROUP
        d = tl.arange(0, BLOCK_D)
        d_ok = d < head_dim
        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        weight = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for s in range(first, last + 1):
            slot = (s + h).to(tl.int64)
            lse = tl.load(
                part_lse_ptr + slot * stride_ls + token * stride_lt + g,
                mask=row_ok,
                other=float("-inf"),
            )
            m_new = tl.maximum(m, lse)
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m - m_safe)
            w = tl.exp2(lse - m_safe)
            p_off = slot * stride_ps + token * stride_pt + g * stride_pg
            part = tl.load(
                part_ptr + p_off[:, None] + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :],
                other=0.0,
            )
            acc = acc * alpha[:, None] + part * w[:, None]
            weight = weight * alpha + w
            m = m_new
        out = acc / tl.where(weight > 0.0, weight, 1.0)[:, None]
        qhead = h * GROUP + g
        tl.store(
            out_ptr + (token * stride_ot + qhead * stride_oh)[:, None] + d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & d_ok[None, :],
        )


def launch_balanced(
    queries: torch.Tensor,
    key_pool: torch.Tensor,
    value_pool: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    lengths: EntryLengths,
    out: torch.Tensor,
    *,
    scale: float,
    num_reqs: int,
    max_q_len: int,
    num_splits: int,
    block_m: int,
    block_n: int,
    precision: str,
    num_stages: int,
) -> None:
    """Launch :func:`attn_balanced_kernel` and :func:`merge_balanced_kernel` over the step
    (arguments as :func:`lmcompact.kernels.entry_attention.attend_entries`, ``lengths`` its
    :class:`~lmcompact.kernels.entry_attention.EntryLengths`)."""
    total_q, hq, d = queries.shape
    hkv = key_pool.shape[2]
    group = hq // hkv
    slots = hkv * num_splits + hkv
    part = torch.empty(slots, total_q, group, d, dtype=torch.float32, device=queries.device)
    part_lse = torch.empty(slots, total_q, group, dtype=torch.float32, device=queries.device)
    grid = (num_reqs * hkv, triton.cdiv(max_q_len * group, block_m), num_splits)
    attn_balanced_kernel[grid](
        queries,
        key_pool,
        value_pool,
        block_table,
        cu_seqlens_q,
        lengths.kept,
        lengths.tail_start,
        seq_lens,
        lengths.cells,
        lengths.base,
        lengths.entries,
        part,
        part_lse,
        scale * LOG2E,
        d,
        queries.stride(0),
        queries.stride(1),
        *key_pool.stride()[:3],
        block_table.stride(0),
        *part.stride()[:3],
        *part_lse.stride()[:2],
        HKV=hkv,
        GROUP=group,
        BLOCK_SIZE=key_pool.shape[1],
        BLOCK_D=triton.next_power_of_2(d),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        DOT_PRECISION=precision,
        NUM_SPLITS=num_splits,
        num_warps=4,
        num_stages=num_stages,
    )
    merge_balanced_kernel[grid[:2]](
        part,
        part_lse,
        out,
        block_table,
        lengths.entries,
        cu_seqlens_q,
        lengths.kept,
        lengths.tail_start,
        seq_lens,
        d,
        *part.stride()[:3],
        *part_lse.stride()[:2],
        out.stride(0),
        out.stride(1),
        block_table.stride(0),
        HKV=hkv,
        GROUP=group,
        BLOCK_D=triton.next_power_of_2(d),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        NUM_SPLITS=num_splits,
        num_warps=4,
    )
