"""Triton paged attention with per-(request, kv_head) lengths and the block-aligned hole.

Each program owns one (request, kv head), a tile of ``BLOCK_M`` query rows and
one split of the visible keys. Rows pack the GQA group with the queries, so a
key tile is loaded once for every query head that shares it::

    row r = i * G + g      query i of the request, query head h * G + g
    key c = 0 .. kept + tail_len - 1 (the hole is never visited)
      slot(c) = c                       if c < kept
              = c - kept + tail_start   otherwise
    visible(r, c) = c < kept  or  slot(c) <= seq_len - q_len + i

Decode (``q_len = 1``) splits the keys over many programs (flash-decoding);
a second kernel merges the splits by their log-sum-exp. With
``return_key_mass`` a third pass recomputes the probabilities with the final
log-sum-exp and sums them per key (H2O / TOVA decode-time scores).
float32 inputs take IEEE dot products unless ``torch.backends.cuda.matmul.allow_tf32``
is set (see :func:`_dot_precision`).
Reference: :func:`lmcompact.kernels.reference_paged.paged_attention_reference`.
"""

from __future__ import annotations

import functools
import math

import torch
import triton  # type: ignore[import-untyped]
import triton.language as tl  # type: ignore[import-untyped]

from lmcompact.kernels.reference_paged import check_queries
from lmcompact.layout.paged import PagedLengths, check_pool

LOG2E = 1.4426950408889634


@triton.jit
def _visible_range(kept_ptr, tail_ptr, seq_ptr, b, h, HKV: tl.constexpr):
    kept = tl.load(kept_ptr + b * HKV + h).to(tl.int32)
    tail = tl.load(tail_ptr + b).to(tl.int32)
    seq = tl.load(seq_ptr + b).to(tl.int32)
    return kept, tail, seq


@triton.jit
def _attn_split_kernel(
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
):
    pid_bh = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_s = tl.program_id(2)
    b = pid_bh // HKV
    h = pid_bh % HKV
    q_lo = tl.load(cu_q_ptr + b).to(tl.int32)
    q_len = tl.load(cu_q_ptr + b + 1).to(tl.int32) - q_lo
    n_rows = q_len * GROUP
    if pid_m * BLOCK_M < n_rows:
        kept, tail, seq = _visible_range(kept_ptr, tail_ptr, seq_ptr, b, h, HKV)
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
        for c0 in range(c_lo, c_hi, BLOCK_N):
            c = c0 + tl.arange(0, BLOCK_N)
            c_ok = c < c_hi
            slot = tl.where(c < kept, c, c + (tail - kept))
            blk = tl.load(row_base + slot // BLOCK_SIZE, mask=c_ok, other=0).to(tl.int64)
            k_off = blk * stride_kb + (slot % BLOCK_SIZE) * stride_ks + h * stride_kh
            k = tl.load(
                k_ptr + k_off[None, :] + d[:, None], mask=c_ok[None, :] & d_ok[:, None], other=0
            ).to(q.dtype)  # int8 -> q's dtype is exact (|k| <= 127)
            s = tl.dot(q, k, input_precision=DOT_PRECISION) * scale_log2
            if QUANT:  # per-token scales: keys scale the logits, values the probabilities
                s_off = blk * stride_sb + (slot % BLOCK_SIZE) * stride_ss + h * stride_sh
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
def _merge_splits_kernel(
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
def _key_mass_kernel(
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
    kept, tail, seq = _visible_range(kept_ptr, tail_ptr, seq_ptr, b, h, HKV)
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


def _check_lengths(lengths: PagedLengths, batch: int, hkv: int, device: torch.device) -> None:
    if lengths.kept.shape != (batch, hkv) or lengths.seq_len.shape != (batch,):
        raise ValueError(
            f"lengths must be kept ({batch}, {hkv}), tail_start and seq_len ({batch},); got "
            f"{tuple(lengths.kept.shape)}, {tuple(lengths.tail_start.shape)}, "
            f"{tuple(lengths.seq_len.shape)}"
        )
    for t in (lengths.kept, lengths.tail_start, lengths.seq_len):
        if t.device != device or t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"lengths must be int32/int64 on {device}, got {t.dtype} {t.device}")
    if not lengths.kept.is_contiguous():
        raise ValueError("lengths.kept must be contiguous")


def _dot_precision(dtype: torch.dtype) -> str:
    """Triton ``tl.dot`` input precision: float32 inputs follow torch's TF32 switch.

    ``torch.backends.cuda.matmul.allow_tf32`` (off by default) decides, as for
    torch's own float32 matmuls, so a float32 model gets the same logits as
    SDPA to float32 rounding; float16/bfloat16 inputs keep Triton's default.
    """
    if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
        return "ieee"
    return "tf32"


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # Triton's CPU interpreter
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


def _num_splits(work: int, max_visible: int, block_n: int, device: torch.device) -> int:
    """Key splits so that about 16 programs per SM run, each with >= 4 key tiles.

    On the H200 (decode, 32 requests x 8 kv heads, ~5k keys per head) about 8
    splits ran 14% faster than 3, and 128-key tiles 7% faster than 64
    (``lmcompact bench kernels --variants``).
    """
    want = max(1, -(-16 * _sm_count(device) // max(work, 1)))
    return max(1, min(want, -(-max_visible // (4 * block_n))))


def paged_attention(
    queries: torch.Tensor,
    key_pool: torch.Tensor,
    value_pool: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    lengths: PagedLengths,
    *,
    scale: float | None = None,
    return_key_mass: bool = False,
    max_q_len: int | None = None,
    max_visible: int | None = None,
    num_splits: int | None = None,
    block_n: int | None = None,
    num_warps: int = 4,
    num_stages: int = 3,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Paged attention over compacted per-head KV (Triton); see the module docstring.

    Args:
        queries: ``(total_q, Hq, D)`` fp16/bf16/fp32, head_dim contiguous.
        key_pool, value_pool: ``(num_blocks, block_size, Hkv, D)`` views, same strides
            (:func:`lmcompact.layout.paged.vllm_kv_views` gives them for vLLM 0.26).
        block_table: ``(B, max_blocks)`` int32/int64, row-contiguous.
        cu_seqlens_q: ``(B + 1,)`` query offsets (decode: ``arange(B + 1)``).
        lengths: kept / tail_start / seq_len on the queries' device.
        scale: Softmax scale (default ``1 / sqrt(D)``).
        return_key_mass: Also return ``(B, Hkv, max_blocks * block_size)`` mass per slot.
        max_q_len: Longest query run (host int; computed with a sync if None).
        max_visible: Most keys any head sees (host int; computed with a sync if None).
        num_splits: Key splits per (request, head); None picks one to fill the GPU.
        block_n, num_warps, num_stages: Tile and launch parameters (``block_n`` None:
            128 keys per tile for decode-sized row tiles, 64 otherwise).

    Returns:
        Output ``(total_q, Hq, D)`` in the queries' dtype and the optional mass.
    """
    _, bs, hkv, d = check_pool(key_pool, value_pool)
    batch, group = check_queries(queries, cu_seqlens_q, hkv, d)
    device = queries.device
    if key_pool.device != device or block_table.device != device or cu_seqlens_q.device != device:
        raise ValueError(f"pools, block table and cu_seqlens_q must be on {device}")
    if key_pool.dtype != queries.dtype:
        raise ValueError(f"pool dtype {key_pool.dtype} differs from queries {queries.dtype}")
    if queries.stride(2) != 1:
        raise ValueError("queries must have a contiguous head_dim")
    if block_table.dim() != 2 or block_table.shape[0] != batch or block_table.stride(1) != 1:
        raise ValueError(
            f"block_table must be ({batch}, max_blocks) and row-contiguous, "
            f"got {tuple(block_table.shape)} strides {block_table.stride()}"
        )
    if block_table.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"block_table must be int32 or int64, got {block_table.dtype}")
    _check_lengths(lengths, batch, hkv, device)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    total_q, hq, _ = queries.shape
    if max_q_len is None:
        max_q_len = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max()) if batch else 0
    if max_visible is None:
        max_visible = int(lengths.visible().max()) if batch else 0
    out = torch.zeros(queries.shape, dtype=queries.dtype, device=device)
    mass = (
        torch.zeros(batch, hkv, block_table.shape[1] * bs, device=device)
        if return_key_mass
        else None
    )
    if total_q == 0 or max_q_len == 0:
        return out, mass
    block_m = 16 if max_q_len * group <= 16 else 64
    block_d = triton.next_power_of_2(d)
    m_tiles = triton.cdiv(max_q_len * group, block_m)
    if block_n is None:
        block_n = 128 if block_m == 16 else 64
    if num_splits is None:
        num_splits = _num_splits(batch * hkv * m_tiles, max_visible, block_n, device)
    split_len = triton.cdiv(max(max_visible, 1), num_splits * block_n) * block_n
    num_splits = max(1, triton.cdiv(max(max_visible, 1), split_len))
    lse = torch.empty(total_q, hq, dtype=torch.float32, device=device)
    if num_splits == 1:
        part, part_lse = out, lse[None]
        part_strides: tuple[int, ...] = (0, out.stride(0), out.stride(1))
    else:
        part = torch.empty(num_splits, total_q, hq, d, dtype=torch.float32, device=device)
        part_lse = torch.empty(num_splits, total_q, hq, dtype=torch.float32, device=device)
        part_strides = part.stride()[:3]
    kept = lengths.kept.contiguous()
    precision = _dot_precision(queries.dtype)
    grid = (batch * hkv, m_tiles, num_splits)
    _attn_split_kernel[grid](
        queries,
        key_pool,
        value_pool,
        key_pool,  # no scales: never read (QUANT is off)
        value_pool,
        block_table,
        cu_seqlens_q,
        kept,
        lengths.tail_start,
        lengths.seq_len,
        part,
        part_lse,
        scale * LOG2E,
        split_len,
        d,
        queries.stride(0),
        queries.stride(1),
        *key_pool.stride()[:3],
        0,
        0,
        0,
        block_table.stride(0),
        *part_strides,
        part_lse.stride(0),
        part_lse.stride(1),
        HKV=hkv,
        GROUP=group,
        BLOCK_SIZE=bs,
        BLOCK_D=block_d,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        DOT_PRECISION=precision,
        QUANT=False,
        NUM_SPLITS=0,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if num_splits > 1:
        _merge(part, part_lse, out, lse, num_splits)
    if mass is not None and max_visible > 0:
        mass_block_n = 64
        _key_mass_kernel[(batch * hkv, triton.cdiv(max_visible, mass_block_n))](
            queries,
            key_pool,
            block_table,
            cu_seqlens_q,
            kept,
            lengths.tail_start,
            lengths.seq_len,
            lse,
            mass,
            scale * LOG2E,
            d,
            hq,
            queries.stride(0),
            queries.stride(1),
            *key_pool.stride()[:3],
            block_table.stride(0),
            mass.stride(0),
            mass.stride(1),
            HKV=hkv,
            GROUP=group,
            BLOCK_SIZE=bs,
            BLOCK_D=block_d,
            BLOCK_M=16 if group <= 16 else 64,
            BLOCK_N=mass_block_n,
            DOT_PRECISION=precision,
            num_warps=4,
        )
    return out, mass


def _merge(
    part: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, splits: int
) -> None:
    """Merge ``(splits, T, Hq, D)`` partial outputs into ``out`` by their log-sum-exp."""
    if not out.is_contiguous():
        raise ValueError("internal: output must be contiguous for the split merge")
    total_q, hq, d = out.shape
    _merge_splits_kernel[(total_q * hq,)](
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


def decode_splits(
    batch: int, num_kv_heads: int, head_dim: int, visible: int, device: torch.device
) -> int:
    """Key splits for :func:`paged_decode_attention` at about ``visible`` keys per head."""
    return _num_splits(batch * num_kv_heads, visible, _decode_block_n(head_dim), device)


def _decode_block_n(head_dim: int) -> int:
    return 64 if head_dim > 64 else 128


def paged_decode_attention(
    queries: torch.Tensor,
    key_pool: torch.Tensor,
    value_pool: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    lengths: PagedLengths,
    *,
    scale: float,
    num_splits: int,
    key_scales: torch.Tensor | None = None,
    value_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query per request over a paged pool: a fixed grid, no host reads (CUDA-graph safe).

    Unlike :func:`paged_attention`, nothing here depends on host values that
    change from step to step: each program splits its visible keys into
    ``num_splits`` parts itself from the lengths on the device, so one launch
    (or one captured graph) serves every later step. The caller checks shapes
    once (see :class:`lmcompact.hf.paged.step.DecodeState`).

    int8 pools pass ``key_scales`` / ``value_scales``: per-token float32 scales
    ``(num_blocks, block_size, Hkv)``; the kernel loads int8 K/V, converts them
    in registers (exact), scales the logits by the key scales and the
    probabilities by the value scales.

    Args:
        queries: ``(B, Hq, D)`` (one query per request), head_dim contiguous.
        key_pool, value_pool: ``(num_blocks, block_size, Hkv, D)`` views, float
            in the queries' dtype, or int8 with scales.
        block_table: ``(B, max_blocks)`` int32/int64, row-contiguous.
        cu_seqlens_q: ``(B + 1,)`` ``0, 1, ..., B``.
        lengths: kept ``(B, Hkv)`` contiguous, tail_start and seq_len ``(B,)``.
        scale: Softmax scale.
        num_splits: Key splits per (request, kv head) (:func:`decode_splits`).

    Returns:
        ``(B, Hq, D)`` in the queries' dtype.
    """
    batch, hq, d = queries.shape
    hkv = key_pool.shape[2]
    bs = key_pool.shape[1]
    quant = key_scales is not None and value_scales is not None
    block_n = _decode_block_n(d)
    block_d = triton.next_power_of_2(d)
    out = torch.empty(batch, hq, d, dtype=queries.dtype, device=queries.device)
    lse = torch.empty(batch, hq, dtype=torch.float32, device=queries.device)
    if num_splits == 1:
        part, part_lse = out, lse[None]
        part_strides: tuple[int, ...] = (0, out.stride(0), out.stride(1))
    else:
        part = torch.empty(num_splits, batch, hq, d, dtype=torch.float32, device=queries.device)
        part_lse = torch.empty(num_splits, batch, hq, dtype=torch.float32, device=queries.device)
        part_strides = part.stride()[:3]
    ks = key_scales if quant else key_pool
    vs = value_scales if quant else value_pool
    scale_strides = key_scales.stride() if quant and key_scales is not None else (0, 0, 0)
    group = hq // hkv
    block_m = 16 if group <= 16 else 64
    _attn_split_kernel[(batch * hkv, triton.cdiv(group, block_m), num_splits)](
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
        part,
        part_lse,
        scale * LOG2E,
        0,
        d,
        queries.stride(0),
        queries.stride(1),
        *key_pool.stride()[:3],
        *scale_strides,
        block_table.stride(0),
        *part_strides,
        part_lse.stride(0),
        part_lse.stride(1),
        HKV=hkv,
        GROUP=group,
        BLOCK_SIZE=bs,
        BLOCK_D=block_d,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        DOT_PRECISION=_dot_precision(queries.dtype),
        QUANT=quant,
        NUM_SPLITS=num_splits,
        num_warps=4,
        num_stages=3 if block_d <= 64 else 2,
    )
    if num_splits > 1:
        _merge(part, part_lse, out, lse, num_splits)
    return out
