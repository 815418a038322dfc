"""Different kept counts per head or layer: dense per-head cells and a masked reference.

Ada-KV, PyramidKV and DuoAttention keep different numbers of tokens per (layer, head). One
block table serves every head of a request, so a layer's heads share the request's kept
blocks as *cells* (a block of ``bs`` slots x ``H`` heads is ``bs x H`` cells, see
:mod:`lmcompact.layout.paged`): head after head, each takes as many cells as it keeps::

    kept counts 40, 88, 24, 104 (H = 4, bs = 16): 256 cells = 4 blocks (not ceil(104/16) = 7)
    cells  [ head 0: 40 | head 1: 88 | head 2: 24 | head 3: 104 ]  -> blocks 0..3, then the hole

A request then holds ``max over layers of ceil(sum_h count / (bs * H))`` blocks for its
compacted span, what one count per head at the mean would hold when a layer's counts sum to
the mean's (Ada-KV's per-layer budget); a per-layer budget (PyramidKV) costs its largest
layer. vLLM's kernel cannot read cells, so the per-head recompute
(:mod:`lmcompact.compaction.per_head_attention`) overwrites these requests' attention rows
with :func:`lmcompact.kernels.dispatch.paged_attention` over the cells.

Stored chunks with per-head counts (``store.per_head``) load into the same cells. A stored
chunk holds rows (layer, head)-major, each (layer, head) its own count; a load puts, per
(layer, head), its rows of every chunk one after the other into that head's cells
(:func:`cell_images`: the :func:`dense_image` of those rows, built by one scatter per run of
layers).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lmcompact.compaction.host_copies import host_to_device, is_pinned
from lmcompact.compaction.page_layout import PageLayout
from lmcompact.kernels.reference_paged import paged_attention_reference
from lmcompact.layout.paged import PagedLengths, dense_cells
from lmcompact.store import CompactedChunk


def dense_size(counts: torch.Tensor, block_size: int) -> int:
    """Slots the cells of ``counts`` ``(L, H)`` take: the largest layer's, in whole blocks."""
    return dense_cells(counts, block_size)[1] * block_size


def dense_image(
    rows: torch.Tensor, counts: torch.Tensor, width: int, block_size: int
) -> torch.Tensor:
    """One layer's per-head rows laid out as cells, in the ``(H, width, D)`` form a page write
    of slots takes.

    Args:
        rows: ``(H, n, D)``; head ``h``'s kept rows are ``rows[h, :counts[h]]``.
        counts: ``(H,)`` rows per head.
        width: slots of the dense span (whole blocks; ``sum(counts) <= width * H``).
        block_size: slots per block.

    Returns:
        ``(H, width, D)``: slot ``s`` of head ``g`` holds cell ``(s // bs) * bs * H + g * bs +
        s % bs``; cells after the last head's rows are zero.
    """
    heads = rows.shape[0]
    counts = counts.to(torch.int64).cpu()
    total = int(counts.sum())
    if width % block_size or total > width * heads:
        raise ValueError(
            f"{total} rows do not fit {width} block-aligned slots x {heads} heads of cells"
        )
    starts = torch.cumsum(counts, 0) - counts
    owner = torch.repeat_interleave(torch.arange(heads), counts)
    within = torch.arange(total) - starts[owner]
    source = owner * rows.shape[1] + within
    return _cells_of(rows, source.to(rows.device), width, block_size)


def dense_rows(image: torch.Tensor, counts: torch.Tensor, block_size: int) -> list[torch.Tensor]:
    """The inverse of :func:`dense_image`: head ``h``'s ``(counts[h], D)`` rows of ``image``
    ``(H, width, D)``, the slots ``[0, width)`` of one layer as a page read returns them."""
    heads, width, dim = image.shape
    blocks = width // block_size
    cells = image.reshape(heads, blocks, block_size, dim).transpose(0, 1).reshape(-1, dim)
    starts = (torch.cumsum(counts.to(torch.int64), 0) - counts.to(torch.int64)).tolist()
    return [cells[s : s + int(c)] for s, c in zip(starts, counts.tolist(), strict=True)]


def _cells_of(
    rows: torch.Tensor, source: torch.Tensor, width: int, block_size: int
) -> torch.Tensor:
    """:func:`dense_image` of ``rows`` ``(H, T, D)`` whose kept rows, head after head, are
    ``rows.reshape(H * T, D)[source]`` (``source`` on ``rows``' device)."""
    heads, _, dim = rows.shape
    cells = torch.zeros(width * heads, dim, dtype=rows.dtype, device=rows.device)
    cells[: source.numel()] = rows.reshape(-1, dim)[source]
    blocks = width // block_size
    return cells.view(blocks, heads, block_size, dim).transpose(0, 1).reshape(heads, width, dim)


def pack_per_head(
    kv_layers: Sequence[torch.Tensor],
    layout: PageLayout,
    block_ids: Sequence[int],
    num_tokens: int,
    kept: Sequence[Sequence[torch.Tensor]],
    reserved: int | None = None,
    per_layer: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> tuple[torch.Tensor, int]:
    """Pack each (layer, head)'s own kept tokens as dense cells of slots ``[0, reserved)``.

    Args:
        kv_layers: per layer paged cache ``(num_blocks, H, block_size, 2 * D)``.
        layout: page layout of those caches.
        block_ids: the request's block row.
        num_tokens: tokens compacted (whole blocks).
        kept: per layer, per head sorted token indices in ``[0, num_tokens)``.
        reserved: slots the cells may take (block aligned, every layer's counts summing to
            at most ``reserved * H``); None: the largest layer's, in whole blocks.
        per_layer: the ``(H, num_tokens, D)`` K/V of every layer already read (else read
            here); a copy, so packing in place never overwrites a token still to be read.

    Returns:
        ``counts`` ``(L, H)`` int32 and ``reserved`` (slots ``[reserved, num_tokens)`` are
        the hole). Head ``h``'s cells start at ``sum(counts[l, :h])``.
    """
    bs = layout.block_size
    counts = torch.tensor([[int(k.numel()) for k in heads] for heads in kept], dtype=torch.int32)
    if num_tokens % bs or int(counts.min()) < 1:
        raise ValueError(
            f"per-head pack needs block-aligned num_tokens and >= 1 kept token per head, got "
            f"num_tokens={num_tokens}, min count {int(counts.min())}"
        )
    needed = dense_size(counts, bs)
    reserved = needed if reserved is None else reserved
    if reserved % bs or reserved < needed:
        raise ValueError(
            f"reserved {reserved} must be block aligned and hold the largest layer's cells "
            f"({needed} slots)"
        )
    if reserved >= num_tokens:
        raise ValueError(f"dense kept size {reserved} leaves no hole in {num_tokens} tokens")
    # every layer's source rows, head after head, worked out on the host and sent up in
    # one page-locked copy (a pageable copy per layer would wait for the device each time)
    sources = []
    for heads in kept:
        for head, positions in enumerate(heads):
            if bool((positions < 0).any()) or bool((positions >= num_tokens).any()):
                raise ValueError(f"kept indices of head {head} leave [0, {num_tokens})")
        sources.append(torch.cat([h * num_tokens + p.to(torch.int64) for h, p in enumerate(heads)]))
    flat = torch.cat(sources)
    device = kv_layers[0].device
    flat = host_to_device(device, flat)
    offsets = [0, *torch.cumsum(counts.sum(dim=1, dtype=torch.int64), 0).tolist()]
    for layer, kv in enumerate(kv_layers):
        if per_layer is None:
            keys, values = layout.read(kv, block_ids, 0, num_tokens)
        else:
            keys, values = per_layer[layer]
        source = flat[offsets[layer] : offsets[layer + 1]]
        layout.write(
            kv,
            block_ids,
            0,
            _cells_of(keys, source, reserved, bs),
            _cells_of(values, source, reserved, bs),
        )
    return counts, reserved


def masked_decode_attention(
    queries: torch.Tensor,
    kv_layer: torch.Tensor,
    layout: PageLayout,
    block_ids: Sequence[int],
    counts: torch.Tensor,
    hole_end: int,
    seq_len: int,
    scale: float,
    reserved: int | None = None,
) -> torch.Tensor:
    """Attention of one request's last queries over its dense per-head cells and its tail.

    Args:
        queries: ``(q_len, Hq, D)`` post-RoPE queries of the last ``q_len`` tokens.
        kv_layer: the layer's paged cache.
        layout: its page layout.
        block_ids: the request's block row (hole entries are never read).
        counts: ``(H,)`` kept tokens per kv head of this layer.
        hole_end: first slot after the hole (block aligned).
        seq_len: slots in use.
        scale: softmax scale.
        reserved: slots the cells take (the hole's start); None: the largest layer's
            cells of ``counts`` (one layer here), in whole blocks.

    Returns:
        ``(q_len, Hq, D)`` attention output.
    """
    bs = layout.block_size
    if hole_end % bs:
        raise ValueError(f"hole_end {hole_end} must be a multiple of the block size {bs}")
    k_max = dense_size(counts[None], bs) if reserved is None else reserved
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
    counts = counts.to(device, torch.int64)
    lengths = PagedLengths(
        kept=counts[None],
        tail_start=torch.tensor([k_max], device=device),
        seq_len=torch.tensor([n], device=device),
        dense_start=(torch.cumsum(counts, 0) - counts)[None],
        dense_base=torch.zeros(1, dtype=torch.int64, device=device),
    )
    cu = torch.tensor([0, queries.shape[0]], dtype=torch.int32, device=device)
    out, _ = paged_attention_reference(
        queries.to(device), key_pool, value_pool, table, cu, lengths, scale=scale
    )
    return out


def layer_runs(num_layers: int, layer_bytes: int, limit: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` runs of layers whose per-head rows stay within ``limit`` bytes (one layer
    at least)."""
    step = max(1, limit // max(layer_bytes, 1))
    return [(lo, min(num_layers, lo + step)) for lo in range(0, num_layers, step)]


def cell_images(
    chunks: Sequence[CompactedChunk],
    lo: int,
    hi: int,
    width: int,
    block_size: int,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Layers ``[lo, hi)`` of ``chunks`` as dense cells on ``device``: per (layer, head), its
    rows of every chunk one after the other, each layer's heads laid out as
    :func:`dense_image` lays them out.

    One copy per chunk (its rows of these layers are contiguous) and one scatter per run,
    with every index built from host counts: no per-chunk or per-head launches and no
    device-to-host reads (a load is 64 chunks x 32 layers x 8 heads at 16k tokens).

    Returns:
        keys ``(hi - lo, H, width, Dk)``, values ``(hi - lo, H, width, Dv)`` (cells after a
        layer's last head's rows are zero) and counts ``(hi - lo, H)`` int64 on the CPU:
        each (layer, head)'s rows over all chunks.
    """
    first = chunks[0]
    heads = first.num_kv_heads
    layers = hi - lo
    cells = width * heads  # of one layer
    counts = torch.stack([chunk.kept_counts for chunk in chunks]).to(torch.int64)  # (n, L, H)
    mine = counts[:, lo:hi]
    filled = mine.sum(dim=0)
    widest = int(filled.sum(dim=1).max())
    if width % block_size or widest > cells:
        raise ValueError(
            f"{widest} rows of a layer do not fit {width} block-aligned slots x {heads} heads "
            "of cells"
        )
    # each (chunk, layer, head)'s first cell (layer l's cells start at l * cells): after the
    # layer's earlier heads' cells, then the rows of its head in earlier chunks
    head_start = torch.cumsum(filled, dim=1) - filled
    before = torch.cumsum(mine, dim=0) - mine
    first_cell = before + head_start + torch.arange(layers)[:, None] * cells
    owned = mine.flatten()  # rows of each (chunk, layer, head), in the order they are copied
    shift = first_cell.flatten() - (torch.cumsum(owned, 0) - owned)  # a row's cell - its index
    begins = counts[:, :lo].sum(dim=(1, 2)).tolist()  # each chunk's rows before layer ``lo``
    sizes = mine.sum(dim=(1, 2)).tolist()
    total = sum(sizes)
    # cell c = (block b, head g, slot s) of a layer is slot b * bs + s of head g
    slot_of_cell = (
        torch.arange(layers * cells, device=device)
        .view(layers, heads, width // block_size, block_size)
        .transpose(1, 2)
        .flatten()
    )
    shift, owned = host_to_device(device, torch.stack([shift, owned])).unbind(0)
    cell = torch.arange(total, device=device) + shift.repeat_interleave(owned, output_size=total)
    target = slot_of_cell[cell]
    out = []
    for name, dim in (("keys", first.keys.shape[1]), ("values", first.values.shape[1])):
        moved = torch.empty(total, dim, dtype=first.dtype, device=device)
        at = 0
        for chunk, begin, size in zip(chunks, begins, sizes, strict=True):
            source = getattr(chunk, name)[begin : begin + size]
            moved[at : at + size].copy_(source, non_blocking=is_pinned(source))
            at += size
        image = torch.zeros(layers * cells, dim, dtype=first.dtype, device=device)
        image.index_copy_(0, target, moved)
        out.append(image.view(layers, heads, width, dim))
    return out[0], out[1], filled
