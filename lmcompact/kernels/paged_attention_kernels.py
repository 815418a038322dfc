"""Triton device code of the paged attention over compacted per-head KV.

Three kernels; the launches, the shape checks and the split heuristics are in
:mod:`lmcompact.kernels.paged_attention` (read its module docstring for the
index layout: kept slots, the block-aligned hole, the tail):

- :func:`attn_split_kernel`: one program per (request, kv head), ``BLOCK_M``
  query rows (the GQA group packed with the queries) and one split of the
  visible keys; writes the split's output and log2-sum-exp.
- :func:`merge_splits_kernel`: merges the splits of one ``(token, q_head)`` row
  by their log-sum-exp.
- :func:`key_mass_kernel`: with the final log-sum-exp, the attention mass each
  visible key received (summed over the rows, divided by the group size).

Logits are in base 2 (``scale_log2 = scale * log2(e)``). :func:`launch_split_attention`
launches the first (and the merge) from already checked arguments; :func:`merge_splits`
is the merge launch.
"""

from __future__ import annotations

import torch
import triton  # type: ignore[import-untyped]
import triton.language as tl  # type: ignore[import-untyped]

from lmcompact.layout.paged import PagedLengths

LOG2E = 1.4426950408889634


@triton.jit
def _visible_range(kept_ptr, tail_ptr, seq_ptr, e, b, h, HKV: tl.constexpr):
    """Kept keys and tail start of entry ``e``; key length of batch row ``b``."""
    kept = tl.load(kept_ptr + e * HKV + h).to(tl.int32)
    tail = tl.load(tail_ptr + e).to(tl.int32)
    seq = tl.load(seq_ptr + b).to(tl.int32)
    return kept, tail, seq


@triton.jit
def _row_entry(table_ptr, entry_ptr, b, stride_tb, LOOKUP: tl.constexpr):
    """The lengths entry of batch row ``b``: ``b`` itself, or with ``LOOKUP`` the entry the
    row's first block maps to (-1: not a per-head row, the program does nothing)."""
    if LOOKUP:
        first = tl.load(table_ptr + b.to(tl.int64) * stride_tb).to(tl.int64)
        e = tl.load(entry_ptr + first).to(tl.int32)
    else:
        e = b
    return e


@triton.jit
def _attend_span(
    q,
    m_i,
    l_i,
    acc,
    c_lo,
    c_hi,
    kept,
    tail,
    q_slot,
    base,
    first_cell,
    h,
    row_base,
    k_ptr,
    v_ptr,
    ks_ptr,
    vs_ptr,
    d,
    d_ok,
    scale_log2,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_sb,
    stride_ss,
    stride_sh,
    HKV: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    QUANT: tl.constexpr,
    DENSE: tl.constexpr,
):
    """Online softmax of head ``h``'s query rows ``q`` over its visible keys ``[c_lo, c_hi)``
    (key ``c < kept``: kept slot ``c``, or with ``DENSE`` past ``base`` its cell ``first_cell
    + c - base``; ``c >= kept``: tail slot ``c + tail - kept``), carried in ``(m_i, l_i,
    acc)``."""
    for c0 in range(c_lo, c_hi, BLOCK_N):
        c = c0 + tl.arange(0, BLOCK_N)
        c_ok = c < c_hi
        slot = tl.where(c < kept, c, c + (tail - kept))
        if DENSE:
            in_cells = (c >= base) & (c < kept)
            cell = first_cell + c - base
            cell_in_block = cell % (BLOCK_SIZE * HKV)
            entry = tl.where(in_cells, cell // (BLOCK_SIZE * HKV), slot // BLOCK_SIZE)
            offset = tl.where(in_cells, cell_in_block % BLOCK_SIZE, slot % BLOCK_SIZE)
            head = tl.where(in_cells, cell_in_block // BLOCK_SIZE, h)
        else:
            entry = slot // BLOCK_SIZE
            offset = slot % BLOCK_SIZE
            head = h
        blk = tl.load(row_base + entry, mask=c_ok, other=0).to(tl.int64)
        k_off = blk * stride_kb + offset * stride_ks + head * stride_kh
        k = tl.load(
            k_ptr + k_off[None, :] + d[:, None], mask=c_ok[None, :] & d_ok[:, None], other=0
        ).to(q.dtype)  # int8 -> q's dtype is exact (|k| <= 127)
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * scale_log2
        if QUANT:  # per-token scales: keys scale the logits, values the probabilities
            s_off = blk * stride_sb + offset * stride_ss + head * stride_sh
            s = s * tl.load(ks_ptr + s_off, mask=c_ok, other=0.0)[None, :]
        seen = c_ok[None, :] & ((c < kept)[None, :] | (slot[None, :] <= q_slot[:, None]))
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_ptr + k_off[:, None] + d[None, :], mask=c_ok[:, None] & d_ok[None, :], other=0
        ).to(q.dtype)
        if QUANT:
            p = p * tl.load(vs_ptr + s_off, mask=c_ok, other=0.0)[None, :]
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def attn_split_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    ks_ptr,
    vs_ptr,
    table_ptr,
    cu_q_ptr,
    kept_ptr,
    tail_ptr,
    seq_ptr,
    dense_start_ptr,
    dense_base_ptr,
    entry_ptr,
    out_ptr,
    lse_ptr,
    scale_log2,
    split_len,
    head_dim,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_sb,
    stride_ss,
    stride_sh,
    stride_tb,
    stride_os,
    stride_ot,
    stride_oh,
    stride_ls,
    stride_lt,
    HKV: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    QUANT: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DENSE: tl.constexpr,
    LOOKUP: tl.constexpr,
):
    pid_bh = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_s = tl.program_id(2)
    b = pid_bh // HKV
    h = pid_bh % HKV
    q_lo = tl.load(cu_q_ptr + b).to(tl.int32)
    q_len = tl.load(cu_q_ptr + b + 1).to(tl.int32) - q_lo
    n_rows = q_len * GROUP
    e = _row_entry(table_ptr, entry_ptr, b, stride_tb, LOOKUP)
    if (pid_m * BLOCK_M < n_rows) & (e >= 0):
        kept, tail, seq = _visible_range(kept_ptr, tail_ptr, seq_ptr, e, b, h, HKV)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < n_rows
        qi = rows // GROUP
        qhead = h * GROUP + rows % GROUP
        q_slot = seq - q_len + qi
        # keys past the tile's last query are invisible to every row of the tile
        last_q = tl.minimum(q_len - 1, (pid_m * BLOCK_M + BLOCK_M - 1) // GROUP)
        c_end = kept + (seq - q_len + last_q) - tail + 1
        if NUM_SPLITS > 0:  # the split length follows the lengths on the device (fixed grid)
            split_len = tl.cdiv(tl.cdiv(tl.maximum(c_end, 1), NUM_SPLITS), BLOCK_N) * BLOCK_N
        c_lo = pid_s * split_len
        c_hi = tl.minimum(c_lo + split_len, c_end)
        d = tl.arange(0, BLOCK_D)
        d_ok = d < head_dim
        q_off = (q_lo + qi).to(tl.int64) * stride_qt + qhead * stride_qh
        q = tl.load(
            q_ptr + q_off[:, None] + d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0
        )
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        row_base = table_ptr + b.to(tl.int64) * stride_tb
        base = 0
        first_cell = 0
        if DENSE:  # kept keys past `base` sit in the head's dense cells (layout.paged)
            base = tl.load(dense_base_ptr + e).to(tl.int32)
            first_cell = tl.load(dense_start_ptr + e * HKV + h).to(tl.int32)
        m_i, l_i, acc = _attend_span(
            q,
            m_i,
            l_i,
            acc,
            c_lo,
            c_hi,
            kept,
            tail,
            q_slot,
            base,
            first_cell,
            h,
            row_base,
            k_ptr,
            v_ptr,
            ks_ptr,
            vs_ptr,
            d,
            d_ok,
            scale_log2,
            stride_kb,
            stride_ks,
            stride_kh,
            stride_sb,
            stride_ss,
            stride_sh,
            HKV,
            BLOCK_SIZE,
            BLOCK_N,
            DOT_PRECISION,
            QUANT,
            DENSE,
        )
        has = l_i > 0.0
        out = acc / tl.where(has, l_i, 1.0)[:, None]
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        o_off = pid_s * stride_os + (q_lo + qi).to(tl.int64) * stride_ot + qhead * stride_oh
        tl.store(
            out_ptr + o_off[:, None] + d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & d_ok[None, :],
        )
        l_off = pid_s * stride_ls + (q_lo + qi).to(tl.int64) * stride_lt + qhead
        tl.store(lse_ptr + l_off, lse, mask=row_ok)


@triton.jit
def merge_splits_kernel(
    part_ptr,
    part_lse_ptr,
    out_ptr,
    lse_ptr,
    num_splits,
    head_dim,
    num_rows,
    stride_ps,
    stride_ls,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # row = token * Hq + q_head
    s = tl.arange(0, BLOCK_S)
    s_ok = s < num_splits
    lse = tl.load(part_lse_ptr + s * stride_ls + row, mask=s_ok, other=float("-inf"))
    m = tl.max(lse, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m_safe)
    total = tl.sum(w, 0)
    d = tl.arange(0, BLOCK_D)
    part = tl.load(
        part_ptr + s[:, None] * stride_ps + row * head_dim + d[None, :],
        mask=s_ok[:, None] & (d < head_dim)[None, :],
        other=0.0,
    )
    out = tl.sum(part * w[:, None], 0) / tl.where(total > 0.0, total, 1.0)
    tl.store(out_ptr + row * head_dim + d, out.to(out_ptr.dtype.element_ty), mask=d < head_dim)
    tl.store(lse_ptr + row, tl.where(total > 0.0, m_safe + tl.log2(total), float("-inf")))


@triton.jit
def merge_request_splits_kernel(
    part_ptr,
    part_lse_ptr,
    out_ptr,
    table_ptr,
    entry_ptr,
    cu_q_ptr,
    head_dim,
    stride_ps,
    stride_pt,
    stride_ph,
    stride_ls,
    stride_lt,
    stride_ot,
    stride_oh,
    stride_tb,
    HKV: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    """:func:`merge_splits_kernel` on :func:`attn_split_kernel`'s grid with ``LOOKUP``: only
    the rows of per-head requests are merged and written (the rest of ``out`` is vLLM's)."""
    pid_bh = tl.program_id(0)
    pid_m = tl.program_id(1)
    b = pid_bh // HKV
    h = pid_bh % HKV
    q_lo = tl.load(cu_q_ptr + b).to(tl.int32)
    n_rows = (tl.load(cu_q_ptr + b + 1).to(tl.int32) - q_lo) * GROUP
    e = _row_entry(table_ptr, entry_ptr, b, stride_tb, True)
    if (pid_m * BLOCK_M < n_rows) & (e >= 0):
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < n_rows
        token = (q_lo + rows // GROUP).to(tl.int64)
        qhead = h * GROUP + rows % GROUP
        d = tl.arange(0, BLOCK_D)
        d_ok = d < head_dim
        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        total = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for s in range(NUM_SPLITS):
            lse = tl.load(
                part_lse_ptr + s * stride_ls + token * stride_lt + qhead,
                mask=row_ok,
                other=float("-inf"),
            )
            m_new = tl.maximum(m, lse)
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m - m_safe)
            w = tl.exp2(lse - m_safe)
            part = tl.load(
                part_ptr
                + s * stride_ps
                + token[:, None] * stride_pt
                + (qhead * stride_ph)[:, None]
                + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :],
                other=0.0,
            )
            acc = acc * alpha[:, None] + part * w[:, None]
            total = total * alpha + w
            m = m_new
        out = acc / tl.where(total > 0.0, total, 1.0)[:, None]
        tl.store(
            out_ptr + token[:, None] * stride_ot + (qhead * stride_oh)[:, None] + d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & d_ok[None, :],
        )


@triton.jit
def key_mass_kernel(
    q_ptr,
    k_ptr,
    table_ptr,
    cu_q_ptr,
    kept_ptr,
    tail_ptr,
    seq_ptr,
    lse_ptr,
    mass_ptr,
    scale_log2,
    head_dim,
    num_heads_q,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_tb,
    stride_mb,
    stride_mh,
    HKV: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid_bh = tl.program_id(0)
    pid_n = tl.program_id(1)
    b = pid_bh // HKV
    h = pid_bh % HKV
    kept, tail, seq = _visible_range(kept_ptr, tail_ptr, seq_ptr, b, b, h, HKV)
    c = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    c_ok = c < kept + seq - tail
    if pid_n * BLOCK_N < kept + seq - tail:
        q_lo = tl.load(cu_q_ptr + b).to(tl.int32)
        q_len = tl.load(cu_q_ptr + b + 1).to(tl.int32) - q_lo
        slot = tl.where(c < kept, c, c + (tail - kept))
        blk = tl.load(
            table_ptr + b.to(tl.int64) * stride_tb + slot // BLOCK_SIZE, mask=c_ok, other=0
        ).to(tl.int64)
        k_off = blk * stride_kb + (slot % BLOCK_SIZE) * stride_ks + h * stride_kh
        d = tl.arange(0, BLOCK_D)
        d_ok = d < head_dim
        k = tl.load(
            k_ptr + k_off[None, :] + d[:, None], mask=c_ok[None, :] & d_ok[:, None], other=0.0
        )
        mass = tl.zeros([BLOCK_N], tl.float32)
        for r0 in range(0, q_len * GROUP, BLOCK_M):
            rows = r0 + tl.arange(0, BLOCK_M)
            row_ok = rows < q_len * GROUP
            qi = rows // GROUP
            qhead = h * GROUP + rows % GROUP
            q_off = (q_lo + qi).to(tl.int64) * stride_qt + qhead * stride_qh
            q = tl.load(
                q_ptr + q_off[:, None] + d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0
            )
            lse = tl.load(
                lse_ptr + (q_lo + qi).to(tl.int64) * num_heads_q + qhead,
                mask=row_ok,
                other=float("-inf"),
            )
            s = tl.dot(q, k, input_precision=DOT_PRECISION) * scale_log2
            q_slot = seq - q_len + qi
            seen = (
                c_ok[None, :]
                & row_ok[:, None]
                & (lse > float("-inf"))[:, None]
                & ((c < kept)[None, :] | (slot[None, :] <= q_slot[:, None]))
            )
            p = tl.exp2(s - tl.where(lse > float("-inf"), lse, 0.0)[:, None])
            mass += tl.sum(tl.where(seen, p, 0.0), 0)
        m_off = b.to(tl.int64) * stride_mb + h * stride_mh + slot
        tl.store(mass_ptr + m_off, mass / GROUP, mask=c_ok)


def launch_split_attention(
    grid: tuple[int, int, int],
    queries: torch.Tensor,
    key_pool: torch.Tensor,
    value_pool: torch.Tensor,
    key_scales: torch.Tensor | None,
    value_scales: torch.Tensor | None,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    lengths: PagedLengths,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    scale: float,
    split_len: int,
    block_m: int,
    block_n: int,
    device_splits: int | None,
    num_splits: int,
    precision: str,
    num_warps: int,
    num_stages: int,
    entries: torch.Tensor | None = None,
) -> None:
    """Launch :func:`attn_split_kernel` over ``grid`` and merge its splits into ``out``.

    With one split the kernel writes ``out`` ``(T, Hq, D)`` and ``lse`` ``(T, Hq)``
    directly; otherwise float32 partials ``(num_splits, T, Hq, D)`` and their
    log-sum-exps are merged by :func:`merge_splits`. ``device_splits`` None: every split
    is ``split_len`` keys (host lengths); an int: each program derives its split
    from the lengths on the device (a fixed grid, CUDA-graph safe). ``key_scales`` /
    ``value_scales`` ``(num_blocks, block_size, Hkv)`` switch on int8 pools; ``precision``
    is ``tl.dot``'s input precision (``"ieee"`` or ``"tf32"``). ``entries`` (one int per
    physical block, -1 for none) switches on the lookup: batch row ``b`` reads entry
    ``entries[block_table[b, 0]]`` of the lengths (rows without one are left untouched in
    ``out``; see :mod:`lmcompact.kernels.entry_attention`).
    """
    total_q, hq, d = out.shape
    if num_splits == 1:
        part, part_lse = out, lse[None]
        part_strides: tuple[int, ...] = (0, out.stride(0), out.stride(1))
    else:
        part = torch.empty(num_splits, total_q, hq, d, dtype=torch.float32, device=out.device)
        part_lse = torch.empty(num_splits, total_q, hq, dtype=torch.float32, device=out.device)
        part_strides = part.stride()[:3]
    dense_start, dense_base = lengths.dense_start, lengths.dense_base
    quant = key_scales is not None and value_scales is not None
    # no scales: the pools stand in for the pointers, never read (QUANT is off)
    ks = key_scales if quant else key_pool
    vs = value_scales if quant else value_pool
    scale_strides = key_scales.stride() if quant and key_scales is not None else (0, 0, 0)
    attn_split_kernel[grid](
        queries,
        key_pool,
        value_pool,
        ks,
        vs,
        block_table,
        cu_seqlens_q,
        lengths.kept,
        lengths.tail_start,
        lengths.seq_len,
        lengths.kept if dense_start is None else dense_start,  # a stand-in unless DENSE
        lengths.seq_len if dense_base is None else dense_base,
        lengths.seq_len if entries is None else entries,  # a stand-in unless LOOKUP
        part,
        part_lse,
        scale * LOG2E,
        split_len,
        d,
        queries.stride(0),
        queries.stride(1),
        *key_pool.stride()[:3],
        *scale_strides,
        block_table.stride(0),
        *part_strides,
        part_lse.stride(0),
        part_lse.stride(1),
        HKV=key_pool.shape[2],
        GROUP=hq // key_pool.shape[2],
        BLOCK_SIZE=key_pool.shape[1],
        BLOCK_D=triton.next_power_of_2(d),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        DOT_PRECISION=precision,
        QUANT=quant,
        NUM_SPLITS=0 if device_splits is None else device_splits,
        DENSE=dense_start is not None,
        LOOKUP=entries is not None,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if num_splits > 1 and entries is not None:
        merge_request_splits_kernel[grid[:2]](
            part,
            part_lse,
            out,
            block_table,
            entries,
            cu_seqlens_q,
            d,
            *part.stride()[:3],
            part_lse.stride(0),
            part_lse.stride(1),
            out.stride(0),
            out.stride(1),
            block_table.stride(0),
            HKV=key_pool.shape[2],
            GROUP=hq // key_pool.shape[2],
            BLOCK_D=triton.next_power_of_2(d),
            BLOCK_M=block_m,
            NUM_SPLITS=num_splits,
            num_warps=4,
        )
    elif num_splits > 1:
        merge_splits(part, part_lse, out, lse, num_splits)


def merge_splits(
    part: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, splits: int
) -> None:
    """Merge ``(splits, T, Hq, D)`` partial outputs into ``out`` by their log-sum-exp."""
    if not out.is_contiguous():
        raise ValueError("internal: output must be contiguous for the split merge")
    total_q, hq, d = out.shape
    merge_splits_kernel[(total_q * hq,)](
        part,
        part_lse,
        out,
        lse,
        splits,
        d,
        total_q * hq,
        part.stride(0),
        part_lse.stride(0),
        BLOCK_S=triton.next_power_of_2(splits),
        BLOCK_D=triton.next_power_of_2(d),
        num_warps=1,
    )
