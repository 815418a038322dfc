"""SnapKV pooling of per-key scores, applied right after the window scores."""

from __future__ import annotations

import torch


def pool_scores(mass: torch.Tensor, kernel_size: int, kind: str = "max") -> torch.Tensor:
    """SnapKV pooling of ``(B, Hkv, T)`` scores along T (odd kernel, same length).

    Args:
        mass: ``(B, Hkv, T)`` float scores.
        kernel_size: Odd window (SnapKV uses 5 to 7); 1 returns the input.
        kind: ``"max"`` or ``"avg"``.
    """
    if kernel_size < 1 or kernel_size % 2 == 0:
        raise ValueError(f"kernel_size must be odd and >= 1, got {kernel_size}")
    if kind not in ("max", "avg"):
        raise ValueError(f"kind must be 'max' or 'avg', got {kind!r}")
    if mass.dim() != 3:
        raise ValueError(f"mass must be (batch, kv_heads, T), got {tuple(mass.shape)}")
    if kernel_size == 1:
        return mass
    flat = mass.reshape(-1, 1, mass.shape[-1])
    pad = kernel_size // 2
    if kind == "max":
        pooled = torch.nn.functional.max_pool1d(flat, kernel_size, stride=1, padding=pad)
    else:
        pooled = torch.nn.functional.avg_pool1d(
            flat, kernel_size, stride=1, padding=pad, count_include_pad=False
        )
    return pooled.view_as(mass)
