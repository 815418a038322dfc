"""Loaded chunks with per-head counts (``store.per_head``) laid out as padded head rows.

Engine-free (torch + the store's chunk type). A stored chunk holds rows (layer, head)-major,
each (layer, head) its own count. A load writes, per (layer, head), its rows of every
chunk one after the other and zeros up to ``n x slots``::

    chunk 0 rows   [ (0,0) x3 | (0,1) x1 | (1,0) x2 | (1,1) x2 ]
    chunk 1 rows   [ (0,0) x1 | (0,1) x3 | (1,0) x2 | (1,1) x2 ]
    layer 0 head 0 [ c0 c0 c0 c1 0 0 0 0 ]      n x slots = 8
    layer 0 head 1 [ c0 c1 c1 c1 0 0 0 0 ]

:func:`head_rows` builds those rows for a run of layers (one ``index_copy_`` per chunk), so
a load holds at most a bounded run of layers on the device at a time.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lmcompact.store import CompactedChunk


def layer_runs(num_layers: int, layer_bytes: int, limit: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` runs of layers whose padded rows stay within ``limit`` bytes (one layer
    at least)."""
    step = max(1, limit // max(layer_bytes, 1))
    return [(lo, min(num_layers, lo + step)) for lo in range(0, num_layers, step)]


def head_rows(
    chunks: Sequence[CompactedChunk],
    lo: int,
    hi: int,
    slots: int,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Layers ``[lo, hi)`` of ``chunks`` as padded per-head rows on ``device``.

    Returns:
        keys ``(hi - lo, H, n * slots, Dk)``, values ``(hi - lo, H, n * slots, Dv)`` (zeros
        after each head's rows) and counts ``(hi - lo, H)`` int64 on the CPU: each (layer,
        head)'s rows over all chunks.
    """
    first = chunks[0]
    heads = first.num_kv_heads
    width = len(chunks) * slots
    size = (hi - lo, heads, width)
    keys = torch.zeros(*size, first.keys.shape[1], dtype=first.dtype, device=device)
    values = torch.zeros(*size, first.values.shape[1], dtype=first.dtype, device=device)
    flat_keys, flat_values = keys.view(-1, keys.shape[-1]), values.view(-1, values.shape[-1])
    owners = torch.arange((hi - lo) * heads)
    filled = torch.zeros((hi - lo) * heads, dtype=torch.int64)
    for chunk in chunks:
        counts = chunk.kept_counts.to(torch.int64)
        if int(counts.max()) > slots:
            raise ValueError(f"a chunk holds {int(counts.max())} rows for a head, over {slots}")
        begin = int(counts[:lo].sum())  # rows of the layers before ``lo``
        mine = counts[lo:hi].flatten()
        total = int(mine.sum())
        owner = owners.repeat_interleave(mine)
        within = torch.arange(total) - (torch.cumsum(mine, 0) - mine)[owner]
        target = (owner * width + filled[owner] + within).to(device)
        rows = slice(begin, begin + total)
        flat_keys.index_copy_(0, target, on_device(device, chunk.keys[rows]))
        flat_values.index_copy_(0, target, on_device(device, chunk.values[rows]))
        filled += mine
    return keys, values, filled.view(hi - lo, heads)


def on_device(device: torch.device, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` on ``device``; from page-locked host memory without a per-copy wait."""
    if tensor.device == device:
        return tensor
    return tensor.to(device, non_blocking=tensor.device.type == "cpu" and tensor.is_pinned())
