"""Triton kernels of the device-resident pack: every layer of one request in one launch.

vLLM keeps one paged cache tensor per layer, each its own allocation. A table of the layers'
base addresses (``int64``, on the device) lets one launch cover all of them::

    ptrs[l]           = kv_layers[l].data_ptr()
    kv_l[b, h, n, c]  = element at ptrs[l] + b * stride_b + h * stride_h + n * stride_n + c
                        (c < D: key, D <= c < 2D: value; every layer shares shape and strides)

``gather_pages`` copies the request's first ``nb`` blocks of every layer into one
token-major buffer (a copy, so the pack never reads a slot it already overwrote)::

    buf[l, t, h, :] = kv_l[row[t // bs], h, t % bs, :]          buf: (L, nb * bs, H, 2D)
    grid = (L, nb, H)                                            one page row per program

``scatter_kept`` writes each (layer, head)'s kept tokens into the request's first slots::

    kv_l[row[j // bs], h, j % bs, :] = buf[l, index[l, h, j], h, :]     j < K
    grid = (L, H, ceil(K / BLOCK_T))

Both kernels run on the caller's current stream; anything that writes those pages later on
the same stream is ordered after them. References: :func:`gather_pages_reference`,
:func:`scatter_kept_reference` (plain torch, any device).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton  # type: ignore[import-untyped]
import triton.language as tl  # type: ignore[import-untyped]

BLOCK_T = 32


@triton.jit
def _gather_pages_kernel(
    ptrs,
    row,
    out,
    stride_b,
    stride_h,
    stride_n,
    num_tokens,
    H: tl.constexpr,
    BS: tl.constexpr,
    C2: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    layer = tl.program_id(0)
    i = tl.program_id(1)
    h = tl.program_id(2)
    base = tl.load(ptrs + layer).to(tl.pointer_type(out.dtype.element_ty))
    blk = tl.load(row + i).to(tl.int64)
    n = tl.arange(0, BLOCK_N)
    c = tl.arange(0, BLOCK_C)
    mask = (n < BS)[:, None] & (c < C2)[None, :]
    src = base + blk * stride_b + h * stride_h + n.to(tl.int64)[:, None] * stride_n + c[None, :]
    x = tl.load(src, mask=mask)
    token = (i * BS + n).to(tl.int64)
    dst = out + ((layer.to(tl.int64) * num_tokens + token)[:, None] * H + h) * C2 + c[None, :]
    tl.store(dst, x, mask=mask)


@triton.jit
def _scatter_kept_kernel(
    ptrs,
    row,
    src,
    index,
    stride_b,
    stride_h,
    stride_n,
    num_tokens,
    kept,
    H: tl.constexpr,
    BS: tl.constexpr,
    C2: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    layer = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    j = tl.program_id(2) * BLOCK_T + tl.arange(0, BLOCK_T)
    ok = j < kept
    c = tl.arange(0, BLOCK_C)
    mask = ok[:, None] & (c < C2)[None, :]
    p = tl.load(index + (layer * H + h) * kept + j, mask=ok, other=0).to(tl.int64)
    x = tl.load(src + ((layer * num_tokens + p)[:, None] * H + h) * C2 + c[None, :], mask=mask)
    base = tl.load(ptrs + layer).to(tl.pointer_type(src.dtype.element_ty))
    blk = tl.load(row + j // BS, mask=ok, other=0).to(tl.int64)
    slot = (j % BS).to(tl.int64)
    dst = base + (blk * stride_b + h * stride_h + slot * stride_n)[:, None] + c[None, :]
    tl.store(dst, x, mask=mask)


def _check_layers(kv_layers: Sequence[torch.Tensor]) -> tuple[int, int, int, tuple[int, ...]]:
    """``(H, bs, 2D, strides)`` shared by every layer; ValueError otherwise."""
    first = kv_layers[0]
    if first.dim() != 4 or first.stride(3) != 1:
        raise ValueError(
            "paged layers must be (num_blocks, H, block_size, 2 * D) with a contiguous last "
            f"dim, got shape {tuple(first.shape)} strides {first.stride()}"
        )
    for kv in kv_layers:
        if kv.shape[1:] != first.shape[1:] or kv.stride() != first.stride():
            raise ValueError("every paged layer must share shape and strides")
        if kv.dtype != first.dtype or kv.device != first.device:
            raise ValueError("every paged layer must share dtype and device")
    _, h, bs, c2 = first.shape
    return h, bs, c2, tuple(first.stride()[:3])


def layer_pointers(kv_layers: Sequence[torch.Tensor]) -> torch.Tensor:
    """``(L,)`` int64 base addresses of the layers, on their device (build once, reuse)."""
    return torch.tensor(
        [kv.data_ptr() for kv in kv_layers], dtype=torch.int64, device=kv_layers[0].device
    )


def gather_pages(
    kv_layers: Sequence[torch.Tensor], ptrs: torch.Tensor, row: torch.Tensor
) -> torch.Tensor:
    """Token-major copy ``(L, nb * bs, H, 2D)`` of the blocks ``row`` of every layer.

    Args:
        kv_layers: per layer ``(num_blocks, H, bs, 2D)`` paged caches (shape checks only).
        ptrs: :func:`layer_pointers` of ``kv_layers``.
        row: ``(nb,)`` int32/int64 physical block ids, on the device.
    """
    h, bs, c2, (sb, sh, sn) = _check_layers(kv_layers)
    nb = int(row.numel())
    out = torch.empty(
        len(kv_layers), nb * bs, h, c2, dtype=kv_layers[0].dtype, device=kv_layers[0].device
    )
    if nb == 0:
        return out
    _gather_pages_kernel[(len(kv_layers), nb, h)](
        ptrs,
        row,
        out,
        sb,
        sh,
        sn,
        nb * bs,
        H=h,
        BS=bs,
        C2=c2,
        BLOCK_N=triton.next_power_of_2(bs),
        BLOCK_C=triton.next_power_of_2(c2),
        num_warps=4,
    )
    return out


def scatter_kept(
    kv_layers: Sequence[torch.Tensor],
    ptrs: torch.Tensor,
    row: torch.Tensor,
    pages: torch.Tensor,
    index: torch.Tensor,
) -> None:
    """Write ``pages[l, index[l, h, j], h]`` into slot ``j`` of head ``h`` of every layer.

    Args:
        kv_layers: per layer ``(num_blocks, H, bs, 2D)`` paged caches (written).
        ptrs: :func:`layer_pointers` of ``kv_layers``.
        row: ``(nb,)`` physical block ids of the request, on the device.
        pages: ``(L, T, H, 2D)`` from :func:`gather_pages` (must not alias the caches).
        index: ``(L, H, K)`` int64 token indices into ``[0, T)``; ``K`` is a multiple of bs.
    """
    h, bs, c2, (sb, sh, sn) = _check_layers(kv_layers)
    layers, kept = index.shape[0], index.shape[2]
    if index.shape[1] != h or pages.shape != (layers, pages.shape[1], h, c2):
        raise ValueError(
            f"index {tuple(index.shape)} / pages {tuple(pages.shape)} do not match H={h}, 2D={c2}"
        )
    if kept == 0:
        return
    index = index.contiguous()
    _scatter_kept_kernel[(layers, h, triton.cdiv(kept, BLOCK_T))](
        ptrs,
        row,
        pages,
        index,
        sb,
        sh,
        sn,
        pages.shape[1],
        kept,
        H=h,
        BS=bs,
        C2=c2,
        BLOCK_T=BLOCK_T,
        BLOCK_C=triton.next_power_of_2(c2),
        num_warps=4,
    )


# ---------------------------------------------------------------------- references
def gather_pages_reference(kv_layers: Sequence[torch.Tensor], row: torch.Tensor) -> torch.Tensor:
    """Torch reference of :func:`gather_pages` (token-major page layout)."""
    out = []
    for kv in kv_layers:
        pages = kv[row.to(kv.device, torch.int64)]  # (nb, H, bs, 2D)
        out.append(pages.permute(0, 2, 1, 3).reshape(-1, kv.shape[1], kv.shape[3]))
    return torch.stack(out)


def scatter_kept_reference(
    kv_layers: Sequence[torch.Tensor], row: torch.Tensor, pages: torch.Tensor, index: torch.Tensor
) -> None:
    """Torch reference of :func:`scatter_kept` (token-major page layout)."""
    _, heads, kept = index.shape
    for layer, kv in enumerate(kv_layers):
        bs = kv.shape[2]
        rows = pages[layer].transpose(0, 1)  # (H, T, 2D)
        take = torch.gather(rows, 1, index[layer].unsqueeze(-1).expand(-1, -1, rows.shape[-1]))
        blocks = row[: kept // bs].to(kv.device, torch.int64)
        kv[blocks] = take.reshape(heads, kept // bs, bs, -1).permute(1, 0, 2, 3)
