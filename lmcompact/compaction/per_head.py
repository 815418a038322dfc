"""Different kept counts per head or layer: padded packs and a masked reference attention.

Ada-KV, PyramidKV and DuoAttention keep different numbers of tokens per (layer, head). One
block table serves every head of a request, so the pack pads each layer to the request's
largest count ``K_max`` (rounded up to whole blocks) and attention masks each head's
padding::

    head 0 (kept 40)   [ k k k ... k | pad .......... | hole ........ | tail .. ]
    head 1 (kept 88)   [ k k k ......................k | hole ........ | tail .. ]
                       0             40               K_max=96        N

vLLM's own attention kernels take one key length per request, so the masked attention
here is the torch reference of :mod:`lmcompact.kernels.reference_paged` (per-(request,
head) ``kept``); on CPU the request's pages are first copied token-major through the page
layout. Engine-free: torch, the page layout and the kernels' reference.

Stored chunks with per-head counts (``store.per_head``) load into the same padded layout.
A stored chunk holds rows (layer, head)-major, each (layer, head) its own count; a load writes,
per (layer, head), its rows of every chunk one after the other and zeros up to ``n x slots``::

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

from lmcompact.compaction.page_layout import PageLayout
from lmcompact.kernels.reference_paged import paged_attention_reference
from lmcompact.layout.paged import PagedLengths
from lmcompact.store import CompactedChunk


def padded_size(counts: torch.Tensor, block_size: int) -> int:
    """``K_max``: the largest count rounded up to whole blocks."""
    largest = int(counts.max())
    return -(-largest // block_size) * block_size


def pack_per_head(
    kv_layers: Sequence[torch.Tensor],
    layout: PageLayout,
    block_ids: Sequence[int],
    num_tokens: int,
    kept: Sequence[Sequence[torch.Tensor]],
    k_max: int | None = None,
    per_layer: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> tuple[torch.Tensor, int]:
    """Pack each (layer, head)'s own kept tokens into slots ``[0, count)``, zero the padding.

    Args:
        kv_layers: per layer paged cache ``(num_blocks, H, block_size, 2 * D)``.
        layout: page layout of those caches.
        block_ids: the request's block row.
        num_tokens: tokens compacted (whole blocks).
        kept: per layer, per head sorted token indices in ``[0, num_tokens)``.
        k_max: slots every head holds (block aligned, >= every count); None: the largest
            count rounded up to whole blocks.
        per_layer: the ``(H, num_tokens, D)`` K/V of every layer already read (else read
            here); a copy, so packing in place never overwrites a token still to be read.

    Returns:
        ``counts`` ``(L, H)`` int32 and ``K_max`` (slots ``[K_max, num_tokens)`` are the hole).
    """
    bs = layout.block_size
    counts = torch.tensor([[int(k.numel()) for k in heads] for heads in kept], dtype=torch.int32)
    if num_tokens % bs or int(counts.min()) < 1:
        raise ValueError(
            f"per-head pack needs block-aligned num_tokens and >= 1 kept token per head, got "
            f"num_tokens={num_tokens}, min count {int(counts.min())}"
        )
    k_max = padded_size(counts, bs) if k_max is None else k_max
    if k_max % bs or k_max < int(counts.max()):
        raise ValueError(
            f"k_max {k_max} must be block aligned and hold the largest count {int(counts.max())}"
        )
    if k_max >= num_tokens:
        raise ValueError(f"padded kept size {k_max} leaves no hole in {num_tokens} tokens")
    for layer, (kv, heads) in enumerate(zip(kv_layers, kept, strict=True)):
        if per_layer is None:
            keys, values = layout.read(kv, block_ids, 0, num_tokens)
        else:
            keys, values = per_layer[layer]
        packed_k = torch.zeros(
            keys.shape[0], k_max, keys.shape[2], dtype=keys.dtype, device=keys.device
        )
        packed_v = torch.zeros_like(packed_k)
        for head, index in enumerate(heads):
            if bool((index < 0).any()) or bool((index >= num_tokens).any()):
                raise ValueError(f"kept indices of head {head} leave [0, {num_tokens})")
            index = index.to(keys.device)
            packed_k[head, : index.numel()] = keys[head, index]
            packed_v[head, : index.numel()] = values[head, index]
        layout.write(kv, block_ids, 0, packed_k, packed_v)
    return counts, k_max


def masked_decode_attention(
    queries: torch.Tensor,
    kv_layer: torch.Tensor,
    layout: PageLayout,
    block_ids: Sequence[int],
    counts: torch.Tensor,
    hole_end: int,
    seq_len: int,
    scale: float,
    k_max: int | None = None,
) -> torch.Tensor:
    """Attention of one request's last queries over its padded, holed pages.

    Args:
        queries: ``(q_len, Hq, D)`` post-RoPE queries of the last ``q_len`` tokens.
        kv_layer: the layer's paged cache.
        layout: its page layout.
        block_ids: the request's block row (hole entries are never read).
        counts: ``(H,)`` kept tokens per kv head of this layer.
        hole_end: first slot after the hole (block aligned).
        seq_len: slots in use.
        scale: softmax scale.
        k_max: slots every head holds (the hole's start); None: the largest count rounded
            up to whole blocks.

    Returns:
        ``(q_len, Hq, D)`` attention output.
    """
    bs = layout.block_size
    if hole_end % bs:
        raise ValueError(f"hole_end {hole_end} must be a multiple of the block size {bs}")
    k_max = padded_size(counts, bs) if k_max is None else k_max
    kept_k, kept_v = layout.read(kv_layer, block_ids, 0, k_max)
    tail_k, tail_v = layout.read(kv_layer, block_ids, hole_end, seq_len - hole_end)
    keys = torch.cat([kept_k, tail_k], dim=1)  # (H, k_max + tail, D), hole left out
    values = torch.cat([kept_v, tail_v], dim=1)
    n = keys.shape[1]
    slots = -(-n // bs) * bs
    pad = slots - n
    key_pool = torch.nn.functional.pad(keys, (0, 0, 0, pad)).transpose(0, 1)
    value_pool = torch.nn.functional.pad(values, (0, 0, 0, pad)).transpose(0, 1)
    key_pool = key_pool.reshape(slots // bs, bs, keys.shape[0], keys.shape[2]).contiguous()
    value_pool = value_pool.reshape(slots // bs, bs, keys.shape[0], keys.shape[2]).contiguous()
    device = kv_layer.device
    table = torch.arange(slots // bs, dtype=torch.int32, device=device)[None]
    lengths = PagedLengths(
        kept=counts.to(device, torch.int64)[None],
        tail_start=torch.tensor([k_max], device=device),
        seq_len=torch.tensor([n], device=device),
    )
    cu = torch.tensor([0, queries.shape[0]], dtype=torch.int32, device=device)
    out, _ = paged_attention_reference(
        queries.to(device), key_pool, value_pool, table, cu, lengths, scale=scale
    )
    return out


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
