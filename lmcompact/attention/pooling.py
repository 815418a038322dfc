"""SnapKV pooling of per-key scores: the one implementation, for policies and kernels.

SnapKV (https://arxiv.org/abs/2404.14469) smooths the observation window's
attention mass along the sequence so that the neighbours of an important token
are kept with it. The reference code (FasterDecoding/SnapKV, PyramidKV) and
kvpress's ``SnapKVPress`` call ``F.max_pool1d`` / ``F.avg_pool1d`` with
``padding=kernel_size // 2, stride=1`` and PyTorch's default
``count_include_pad=True``: at the two ends the zero padding counts in the
average, so an edge token's average is diluted. This module does the same, under
the names the papers use (``"maxpool"``, ``"avgpool"``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

POOLINGS = ("maxpool", "avgpool")
"""Pooling kinds, as SnapKV and PyramidKV name them."""


def check_pooling(kernel_size: int, pooling: str) -> None:
    """ValueError naming the bad value unless ``kernel_size`` is odd >= 1 and
    ``pooling`` is one of :data:`POOLINGS`."""
    if isinstance(kernel_size, bool) or not isinstance(kernel_size, int):
        raise ValueError(f"kernel_size must be an odd integer >= 1, got {kernel_size!r}")
    if kernel_size < 1 or kernel_size % 2 == 0:
        raise ValueError(f"kernel_size must be an odd integer >= 1, got {kernel_size}")
    if pooling not in POOLINGS:
        raise ValueError(f"pooling must be one of {POOLINGS}, got {pooling!r}")


def pool_scores(scores: torch.Tensor, kernel_size: int, pooling: str = "maxpool") -> torch.Tensor:
    """Smooth scores along their last axis with a same-length 1-D max or average pool.

    Args:
        scores: ``(..., T)`` float scores (``(H, T)`` in a policy, ``(B, Hkv, T)``
            after the window-scores kernel).
        kernel_size: Odd window width (SnapKV uses 5 to 7); 1 returns ``scores``.
        pooling: ``"maxpool"`` or ``"avgpool"`` (zero padding counts in the
            average, as in SnapKV and kvpress).

    Returns:
        Pooled scores, same shape, dtype and device as ``scores``.
    """
    check_pooling(kernel_size, pooling)
    if scores.dim() < 1:
        raise ValueError("scores must have a token axis (..., T), got a 0-d tensor")
    if kernel_size == 1:
        return scores
    flat = scores.reshape(-1, 1, scores.shape[-1])
    pad = kernel_size // 2
    if pooling == "maxpool":
        pooled = F.max_pool1d(flat, kernel_size, stride=1, padding=pad)
    else:
        pooled = F.avg_pool1d(flat, kernel_size, stride=1, padding=pad, count_include_pad=True)
    return pooled.reshape(scores.shape)
