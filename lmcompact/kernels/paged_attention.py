"""Triton paged attention with per-(request, kv_head) lengths and the block-aligned hole.

Each program owns one (request, kv head), a tile of ``BLOCK_M`` query rows and
one split of the visible keys. Rows pack the GQA group with the queries, so a
key tile is loaded once for every query head that shares it::

    row r = i * G + g      query i of the request, query head h * G + g
    key c = 0 .. kept + tail_len - 1 (the hole is never visited)
      slot(c) = c                       if c < kept
              = c - kept + tail_start   otherwise
      with dense cells, kept keys c >= dense_base are read from cell
      dense_start + c - dense_base of the head's row (lmcompact.layout.paged)
    visible(r, c) = c < kept  or  slot(c) <= seq_len - q_len + i

Decode (``q_len = 1``) splits the keys over many programs (flash-decoding);
a second kernel merges the splits by their log-sum-exp. With
``return_key_mass`` a third pass recomputes the probabilities with the final
log-sum-exp and sums them per key (H2O / TOVA decode-time scores).
float32 inputs take IEEE dot products unless ``torch.backends.cuda.matmul.allow_tf32``
is set (see :func:`_dot_precision`).
Reference: :func:`lmcompact.kernels.reference_paged.paged_attention_reference`.
This module holds the host side (checks, tile and split choices); the Triton
kernels and their launches are in :mod:`lmcompact.kernels.paged_attention_kernels`.
"""

from __future__ import annotations

import functools
import math

import torch
import triton  # type: ignore[import-untyped]

from lmcompact.kernels.paged_attention_kernels import (
    LOG2E,
    key_mass_kernel,
    launch_split_attention,
)
from lmcompact.kernels.reference_paged import check_queries
from lmcompact.layout.paged import PagedLengths, check_pool


def _check_lengths(lengths: PagedLengths, batch: int, hkv: int, device: torch.device) -> None:
    if lengths.kept.shape != (batch, hkv) or lengths.seq_len.shape != (batch,):
        raise ValueError(
            f"lengths must be kept ({batch}, {hkv}), tail_start and seq_len ({batch},); got "
            f"{tuple(lengths.kept.shape)}, {tuple(lengths.tail_start.shape)}, "
            f"{tuple(lengths.seq_len.shape)}"
        )
    dense = [t for t in (lengths.dense_start, lengths.dense_base) if t is not None]
    for t in (lengths.kept, lengths.tail_start, lengths.seq_len, *dense):
        if t.device != device or t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"lengths must be int32/int64 on {device}, got {t.dtype} {t.device}")
    if not lengths.kept.is_contiguous():
        raise ValueError("lengths.kept must be contiguous")
    if lengths.dense_start is not None and not lengths.dense_start.is_contiguous():
        raise ValueError("lengths.dense_start must be contiguous")


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
    """Key splits so that about 16 programs per SM run, each with >= 4 key tiles (the
    split count and tile width were chosen by ``lmcompact bench kernels --variants``:
    ``docs/benchmarks/kernels-h200.md``)."""
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
    if return_key_mass and lengths.dense:
        raise ValueError("key mass per slot is undefined for dense per-head cells")
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
    kept = lengths.kept.contiguous()
    precision = _dot_precision(queries.dtype)
    launch_split_attention(
        (batch * hkv, m_tiles, num_splits),
        queries,
        key_pool,
        value_pool,
        None,
        None,
        block_table,
        cu_seqlens_q,
        PagedLengths(
            kept, lengths.tail_start, lengths.seq_len, lengths.dense_start, lengths.dense_base
        ),
        out,
        lse,
        scale=scale,
        split_len=split_len,
        block_m=block_m,
        block_n=block_n,
        device_splits=None,
        num_splits=num_splits,
        precision=precision,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if mass is not None and max_visible > 0:
        mass_block_n = 64
        key_mass_kernel[(batch * hkv, triton.cdiv(max_visible, mass_block_n))](
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


def decode_splits(
    batch: int, num_kv_heads: int, head_dim: int, visible: int, device: torch.device
) -> int:
    """Key splits for :func:`paged_decode_attention` at about ``visible`` keys per head."""
    return _num_splits(batch * num_kv_heads, visible, _decode_block_n(head_dim), device)


def _decode_block_n(head_dim: int) -> int:
    return 64 if head_dim > 64 else 128


def decode_num_stages(head_dim: int) -> int:
    """Pipeline stages of the decode-sized split launch (fewer for wide heads: shared memory)."""
    return 3 if triton.next_power_of_2(head_dim) <= 64 else 2


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
    quant = key_scales is not None and value_scales is not None
    block_n = _decode_block_n(d)
    out = torch.empty(batch, hq, d, dtype=queries.dtype, device=queries.device)
    lse = torch.empty(batch, hq, dtype=torch.float32, device=queries.device)
    group = hq // hkv
    block_m = 16 if group <= 16 else 64
    launch_split_attention(
        (batch * hkv, triton.cdiv(group, block_m), num_splits),
        queries,
        key_pool,
        value_pool,
        key_scales if quant else None,
        value_scales if quant else None,
        block_table,
        cu_seqlens_q,
        lengths,
        out,
        lse,
        scale=scale,
        split_len=0,
        block_m=block_m,
        block_n=block_n,
        device_splits=num_splits,
        num_splits=num_splits,
        precision=_dot_precision(queries.dtype),
        num_warps=4,
        num_stages=decode_num_stages(d),
    )
    return out
