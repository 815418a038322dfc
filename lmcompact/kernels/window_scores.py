"""Triton window scores: attention mass per key from the last W queries, no T x T.

Two launches over the keys, each program owning ``BLOCK_N`` keys of one
(batch, kv head) and looping over every query row of the GQA group (rows from
L2, keys from memory once per pass)::

    row r = g * W + w          query w of query head h * G + g     (R = G * W rows)
    pass 1  part[b, h, r, n] = log sum_{j in tile n, j <= pos[w]} exp(s[r, j])
            lse[b, h, r]     = logsumexp_n part[b, h, r, n]          (small merge kernel)
    pass 2  mass[b, h, j]    = (1 / G) * sum_r exp(s[r, j] - lse[r])

Splitting pass 1 by key tile (instead of streaming all keys per row) keeps the
grid wide at small batch: ``B * Hkv * T / BLOCK_N`` programs in both passes.
SnapKV pooling runs right after, on the ``(B, Hkv, T)`` mass
(:func:`lmcompact.attention.pooling.pool_scores`).
Reference: :func:`lmcompact.attention.scores.window_scores`.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch
import triton  # type: ignore[import-untyped]
import triton.language as tl  # type: ignore[import-untyped]

from lmcompact.attention.scores import _check_shapes

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


@triton.jit
def _window_pass_kernel(
    q_ptr,
    k_ptr,
    pos_ptr,
    lse_ptr,
    out_ptr,
    scale_log2,
    seq_len,
    window,
    min_pos,
    head_dim,
    stride_qb,
    stride_qh,
    stride_qw,
    stride_kb,
    stride_kh,
    stride_kt,
    stride_lb,
    stride_lh,
    stride_lr,
    stride_ob,
    stride_oh,
    seq_bucket,  # autotuning key only: next power of two of seq_len
    HKV: tl.constexpr,
    GROUP: tl.constexpr,
    MASS: tl.constexpr,
    LAST_W: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    REDUCE_EACH: tl.constexpr,
):
    pid_bh = tl.program_id(0)
    pid_n = tl.program_id(1)
    b = (pid_bh // HKV).to(tl.int64)
    h = pid_bh % HKV
    j = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    j_ok = j < seq_len
    d = tl.arange(0, BLOCK_D)
    d_ok = d < head_dim
    k_base = k_ptr + b * stride_kb + h.to(tl.int64) * stride_kh
    k = tl.load(
        k_base + j.to(tl.int64)[None, :] * stride_kt + d[:, None],
        mask=j_ok[None, :] & d_ok[:, None],
        other=0.0,
    )
    # pass 2 sums p over rows: either per iteration into a key vector (fewer registers,
    # more programs per SM) or once at the end (no cross-warp reduction in the loop)
    if REDUCE_EACH:
        acc = tl.zeros([BLOCK_N], tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    num_rows = GROUP * window
    # keys up to min_pos are seen by every query (min_pos < 0: unknown, always mask)
    tile_seen = pid_n * BLOCK_N + BLOCK_N - 1 <= min_pos
    for r0 in range(0, num_rows, BLOCK_M):
        rows = r0 + tl.arange(0, BLOCK_M)
        row_ok = rows < num_rows
        g = rows // window
        w = rows % window
        q_off = b * stride_qb + (h * GROUP + g).to(tl.int64) * stride_qh + w * stride_qw
        q = tl.load(
            q_ptr + q_off[:, None] + d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0
        )
        if LAST_W:  # noqa: SIM108 (constexpr branch) the window is the last W positions
            pos = seq_len - window + w
        else:
            pos = tl.load(pos_ptr + w, mask=row_ok, other=-1)
        s = tl.dot(q, k) * scale_log2
        l_off = b * stride_lb + h * stride_lh + rows * stride_lr
        if tile_seen and r0 + BLOCK_M <= num_rows:  # every row sees every key: no masks
            if MASS:
                lse = tl.load(lse_ptr + l_off) * 1.4426950408889634
                if REDUCE_EACH:
                    acc += tl.sum(tl.exp2(s - lse[:, None]), 0)
                else:
                    acc += tl.exp2(s - lse[:, None])
            else:
                m = tl.max(s, 1)
                part = (m + tl.log2(tl.sum(tl.exp2(s - m[:, None]), 1))) * 0.6931471805599453
                tl.store(lse_ptr + l_off + pid_n, part)
        else:
            seen = row_ok[:, None] & j_ok[None, :] & (j[None, :] <= pos[:, None])
            if MASS:
                lse = tl.load(lse_ptr + l_off, mask=row_ok, other=float("-inf"))
                lse = lse * 1.4426950408889634
                live = lse > float("-inf")
                p = tl.exp2(s - tl.where(live, lse, 0.0)[:, None])
                if REDUCE_EACH:
                    acc += tl.sum(tl.where(seen & live[:, None], p, 0.0), 0)
                else:
                    acc += tl.where(seen & live[:, None], p, 0.0)
            else:
                s = tl.where(seen, s, float("-inf"))
                m = tl.max(s, 1)
                m_safe = tl.where(m == float("-inf"), 0.0, m)
                total = tl.sum(tl.exp2(s - m_safe[:, None]), 1)
                part = tl.where(
                    total > 0.0,
                    (m_safe + tl.log2(tl.where(total > 0.0, total, 1.0))) * 0.6931471805599453,
                    float("-inf"),
                )
                tl.store(lse_ptr + l_off + pid_n, part, mask=row_ok)
    if MASS:
        o_off = b * stride_ob + h * stride_oh + j
        if REDUCE_EACH:
            tl.store(out_ptr + o_off, acc / GROUP, mask=j_ok)
        else:
            tl.store(out_ptr + o_off, tl.sum(acc, 0) / GROUP, mask=j_ok)


@triton.jit
def _merge_tiles_kernel(
    part_ptr, lse_ptr, num_rows, num_tiles, BLOCK_R: tl.constexpr, BLOCK_T: tl.constexpr
):
    """``lse[row] = logsumexp_t part[row, t]`` over contiguous ``(rows, tiles)``."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < num_rows
    m = tl.full([BLOCK_R], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_R], tl.float32)
    for t0 in range(0, num_tiles, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        x = tl.load(
            part_ptr + rows.to(tl.int64)[:, None] * num_tiles + t[None, :],
            mask=row_ok[:, None] & (t < num_tiles)[None, :],
            other=float("-inf"),
        )
        m_new = tl.maximum(m, tl.max(x, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        total = total * tl.exp(m - m_safe) + tl.sum(tl.exp(x - m_safe[:, None]), 1)
        m = m_new
    lse = tl.where(total > 0.0, m + tl.log(tl.where(total > 0.0, total, 1.0)), float("-inf"))
    tl.store(lse_ptr + rows, lse, mask=row_ok)


def _quick_bench(fn: Any, quantiles: Any = None) -> Any:
    """Autotuning timer: shorter than Triton's default (the kernels run in microseconds)."""
    return triton.testing.do_bench(fn, warmup=5, rep=25, quantiles=quantiles)


# BLOCK_N stays fixed (the pass-1 partials are laid out per key tile); the rest is tuned
# once per (shape, power-of-two length) on the GPU at hand, for sequences of at least
# TUNE_MIN_TOKENS (shorter ones take the fixed default: tuning would cost more than it saves).
# The 8 configurations hold the winners of a 24-configuration search on the H200 (BLOCK_M
# 128 and num_stages 3 never won there; docs/benchmarks/kernels-h200.md).
TUNED_BLOCK_N = 128
TUNE_MIN_TOKENS = 4096
DEFAULT_LAUNCH = {"BLOCK_M": 64, "REDUCE_EACH": False, "num_warps": 4, "num_stages": 2}
_CONFIGS = [
    triton.Config({"BLOCK_M": 64, "REDUCE_EACH": reduce}, num_warps=nw, num_stages=ns)
    for reduce in (False, True)
    for nw in (4, 8)
    for ns in (1, 2)
]
_tuned_pass_kernel = triton.autotune(
    configs=_CONFIGS,
    key=["seq_bucket", "window", "head_dim", "HKV", "GROUP", "MASS", "LAST_W"],
    do_bench=_quick_bench,
)(_window_pass_kernel)


def window_scores(
    queries: torch.Tensor,
    keys: torch.Tensor,
    *,
    query_positions: torch.Tensor | None = None,
    scale: float | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    reduce_each: bool | None = None,
) -> torch.Tensor:
    """Attention mass per key from window queries (Triton), GQA-aware.

    Args:
        queries: ``(B, Hq, W, D)`` fp16/bf16 (fp32 works, through tf32 dots), head_dim
            contiguous.
        keys: ``(B, Hkv, T, D)`` same dtype, head_dim contiguous (any other strides).
        query_positions: ``(W,)`` positions (default the last W); key ``j`` is seen by
            query ``w`` when ``j <= query_positions[w]``.
        scale: Softmax scale (default ``1 / sqrt(D)``).
        block_m, block_n, num_warps, num_stages, reduce_each: A fixed launch
            configuration; all None (the default) autotunes warps, stages and the pass-2
            reduction once per shape and power-of-two length when ``T >=
            TUNE_MIN_TOKENS``, and takes ``DEFAULT_LAUNCH`` below that.

    Returns:
        ``(B, Hkv, T)`` float32: mass summed over window queries, averaged over the
        query heads of each kv group (same as the torch reference).
    """
    hkv, group = _check_shapes(queries, keys)
    b, _, w, d = queries.shape
    t = keys.shape[2]
    if queries.dtype != keys.dtype:
        raise ValueError(f"queries ({queries.dtype}) and keys ({keys.dtype}) must share a dtype")
    if queries.stride(3) != 1 or keys.stride(3) != 1:
        raise ValueError("queries and keys need a contiguous head_dim (stride 1)")
    if queries.device != keys.device:
        raise ValueError(f"queries on {queries.device} but keys on {keys.device}")
    if query_positions is not None and query_positions.shape != (w,):
        raise ValueError(f"query_positions must be ({w},), got {tuple(query_positions.shape)}")
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    if t == 0 or w == 0 or b == 0:
        return torch.zeros(b, hkv, t, dtype=torch.float32, device=queries.device)
    mass = torch.empty(b, hkv, t, dtype=torch.float32, device=queries.device)
    if query_positions is None:
        positions = mass  # unused: the kernel derives the last-W positions
    else:
        positions = query_positions.to(device=queries.device, dtype=torch.int32).contiguous()
    fixed = [block_m, block_n, num_warps, num_stages, reduce_each]
    tuned = all(v is None for v in fixed) and t >= TUNE_MIN_TOKENS
    bn = TUNED_BLOCK_N if block_n is None else block_n
    n_tiles = triton.cdiv(t, bn)
    part = torch.empty(b, hkv, group * w, n_tiles, dtype=torch.float32, device=queries.device)
    common: dict[str, Any] = dict(
        HKV=hkv,
        GROUP=group,
        LAST_W=query_positions is None,
        BLOCK_D=triton.next_power_of_2(d),
        BLOCK_N=bn,
    )
    if tuned:
        kernel: Any = _tuned_pass_kernel
    else:
        kernel = _window_pass_kernel
        given = {
            "BLOCK_M": block_m,
            "REDUCE_EACH": reduce_each,
            "num_warps": num_warps,
            "num_stages": num_stages,
        }
        common.update({k: DEFAULT_LAUNCH[k] if v is None else v for k, v in given.items()})
    min_pos = t - w if query_positions is None else -1
    args = (scale * LOG2E, t, w, min_pos, d, *queries.stride()[:3], *keys.stride()[:3])
    grid = (b * hkv, n_tiles)
    bucket = triton.next_power_of_2(t)
    kernel[grid](
        queries,
        keys,
        positions,
        part,
        mass,
        *args,
        *part.stride()[:3],
        0,
        0,
        bucket,
        MASS=False,
        **common,
    )
    lse = torch.empty(b, hkv, group * w, dtype=torch.float32, device=queries.device)
    _merge_tiles_kernel[(triton.cdiv(lse.numel(), 64),)](
        part, lse, lse.numel(), n_tiles, BLOCK_R=64, BLOCK_T=64, num_warps=4
    )  # lse is -inf for rows that see no key
    kernel[grid](
        queries,
        keys,
        positions,
        lse,
        mass,
        *args,
        *lse.stride(),
        *mass.stride()[:2],
        bucket,
        MASS=True,
        **common,
    )
    return mass


def warm_up_lengths(max_tokens: int) -> list[int]:
    """Key lengths that compile and tune every launch a sequence of up to ``max_tokens``
    can bring: one short (untuned) length, then one per power-of-two tuning bucket."""
    lengths = [min(max_tokens, 1024)]
    length = TUNE_MIN_TOKENS
    while length // 2 < max_tokens and length <= 1 << 20:
        lengths.append(min(length, max_tokens))
        length *= 2
    return list(dict.fromkeys(lengths))


def warm_up(
    query_heads: int,
    kv_heads: int,
    head_dim: int,
    window: int,
    max_tokens: int,
    dtype: torch.dtype,
    device: torch.device,
    scale: float,
) -> list[tuple[int, float]]:
    """Compile and tune :func:`window_scores` for every length up to ``max_tokens`` with
    random queries and keys (the tuning depends on shapes only), so that no request pays
    it.

    Returns:
        ``(tokens, seconds)`` per length warmed.
    """
    done: list[tuple[int, float]] = []
    gen = torch.Generator(device=device).manual_seed(0)
    for tokens in warm_up_lengths(max_tokens):
        if tokens < window:
            continue
        began = time.perf_counter()
        queries = torch.randn(1, query_heads, window, head_dim, device=device, generator=gen)
        keys = torch.randn(1, kv_heads, tokens, head_dim, device=device, generator=gen)
        positions = torch.arange(tokens - window, tokens, device=device)
        window_scores(queries.to(dtype), keys.to(dtype), query_positions=positions, scale=scale)
        torch.cuda.synchronize(device)
        done.append((tokens, time.perf_counter() - began))
    return done
