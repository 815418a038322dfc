"""Symmetric int8 quantization of K/V, one scale per (kv_head, token).

Each stored token of each head keeps its 64 (``head_dim``) values as int8 plus
one float32 scale, ``scale = max|x| / 127``::

    x (head_dim floats)  ->  q = round(x / scale) in [-127, 127],  scale
    dequantized          =   q * scale          (error <= scale / 2 per value)

A per-token scale (rather than one per block) lets a block be filled one
decode token at a time without re-quantizing the tokens already in it, and
moving a token (compaction, copy-on-write) moves its int8 values and scale
unchanged, so no error accumulates. Storage per value: 1 + 4 / head_dim bytes.
"""

from __future__ import annotations

import torch

QMAX = 127.0
_TINY = 1e-12


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize along the last dimension.

    Args:
        x: ``(..., head_dim)`` float tensor.

    Returns:
        ``(..., head_dim)`` int8 values and ``(...)`` float32 scales.
    """
    xf = x.float()
    scale = xf.abs().amax(dim=-1).clamp(min=_TINY) / QMAX
    q = torch.round(xf / scale.unsqueeze(-1)).clamp_(-QMAX, QMAX).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`quantize_int8`: ``(..., head_dim)`` values in ``dtype``."""
    return (q.float() * scale.unsqueeze(-1)).to(dtype)
