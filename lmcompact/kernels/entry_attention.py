"""Per-head attention written into an engine's own output, rows found on the device.

vLLM runs its attention over every request of a batch; for the requests whose prefix is
kept as dense per-head cells (:mod:`lmcompact.layout.paged`) those rows are wrong, and this
launch rewrites them. It gets the engine's whole step (all queries, the block table, the
query offsets and key lengths) and finds the per-head rows itself::

    entry(b) = entries[block_table[b, 0]]     -1: not a per-head request, left as it is
    kept, cells    = kept[entry, h], cells[entry, h]    (one layer's tables)
    tail_start, base = tail_start[entry], base[entry]

so nothing depends on which requests are in the batch: no host reads, no per-step host
work, a fixed grid for a given ``(num_reqs, max_q_len)``, which is what vLLM's full CUDA
graphs need (they replay the launches captured with the engine's fixed buffers).
:class:`EntryLengths` holds the tables; :func:`entry_attention_reference` is the torch
reference the tests compare with.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lmcompact.kernels.reference_paged import paged_attention_reference
from lmcompact.layout.paged import PagedLengths

SCRATCH_BYTES = 64 << 20
"""Most bytes of float32 partial outputs one decode launch may use (it picks fewer splits)."""


@dataclass(frozen=True)
class EntryLengths:
    """One layer's per-head lengths, indexed by entry (int32, on the device).

    Attributes:
        entries: ``(num_blocks,)`` entry of the request whose first block this is, else -1.
        kept: ``(E, Hkv)`` kept keys per head, the ``base`` slots included.
        cells: ``(E, Hkv)`` first dense cell of each head.
        tail_start: ``(E,)`` first slot of the tail (where the request's hole was cut).
        base: ``(E,)`` leading slots every head keeps in the engine's layout.
    """

    entries: torch.Tensor
    kept: torch.Tensor
    cells: torch.Tensor
    tail_start: torch.Tensor
    base: torch.Tensor


def entry_splits(
    num_reqs: int,
    max_q_len: int,
    num_kv_heads: int,
    num_heads: int,
    head_dim: int,
    tokens: int,
    max_keys: int,
    device: torch.device,
) -> int:
    """Key splits of one launch (flash-decoding): enough programs to fill the device, each
    with >= 4 key tiles, as :func:`lmcompact.kernels.paged_attention.paged_attention`
    picks them, within :data:`SCRATCH_BYTES` of partials, rounded down to a power of two
    (fewer kernel variants to compile). Prefill chunks split too: the first step after a
    per-head load prefills the prompt's last few hundred tokens over cells of up to
    ``max_keys`` keys, one program per (head, query tile), too few to fill the device."""
    from lmcompact.kernels.paged_attention import _decode_block_n, _num_splits

    if num_kv_heads < 1 or num_heads < num_kv_heads or num_heads % num_kv_heads:
        raise ValueError(
            f"num_heads ({num_heads}) must be a positive multiple of num_kv_heads ({num_kv_heads})"
        )
    rows = max(max_q_len, 1) * (num_heads // num_kv_heads)
    query_tiles = -(-rows // _block_m(rows))
    work = max(num_reqs, 1) * num_kv_heads * query_tiles
    splits = _num_splits(work, max_keys, _decode_block_n(head_dim), device)
    per_split = max(tokens, 1) * num_heads * head_dim * 4
    splits = max(1, min(splits, SCRATCH_BYTES // per_split))
    return 1 << (splits.bit_length() - 1)


def _block_m(rows: int) -> int:
    """Query rows (queries x the GQA group) per program: one tile for a decode step."""
    return 16 if rows <= 16 else 64


def attend_entries(
    queries: torch.Tensor,
    key_pool: torch.Tensor,
    value_pool: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    lengths: EntryLengths,
    out: torch.Tensor,
    *,
    scale: float,
    num_reqs: int,
    max_q_len: int,
    num_splits: int,
    balanced: bool = False,
) -> None:
    """Overwrite ``out``'s rows of the per-head requests among the first ``num_reqs`` batch
    rows with their attention over their dense cells and tail (Triton, no host reads).

    Args:
        queries: ``(T, Hq, D)`` the step's queries, head_dim contiguous.
        key_pool, value_pool: ``(num_blocks, block_size, Hkv, D)`` paged views.
        block_table: ``(>= num_reqs, max_blocks)`` the step's (hole-cut) block table.
        cu_seqlens_q: ``(num_reqs + 1,)`` query offsets.
        seq_lens: ``(>= num_reqs,)`` key lengths of the (hole-cut) rows.
        lengths: the layer's tables.
        out: ``(T, Hq, D)`` the engine's attention output, head_dim contiguous.
        scale: softmax scale.
        num_reqs, max_q_len: the batch's rows and longest query run (host ints the engine's
            metadata carries; a captured graph fixes them).
        num_splits: :func:`entry_splits`.
        balanced: split the heads' keys laid end to end instead of each head's own, so a
            head with many more keys than the others does not set the launch's time
            (:mod:`lmcompact.kernels.entry_balanced`; ``Hkv x num_splits`` programs either way).
    """
    import triton  # type: ignore[import-untyped]

    from lmcompact.kernels.paged_attention import (
        _decode_block_n,
        _dot_precision,
        decode_num_stages,
    )
    from lmcompact.kernels.paged_attention_kernels import launch_split_attention

    if num_reqs == 0 or max_q_len == 0:
        return
    total_q, hq, d = queries.shape
    hkv = key_pool.shape[2]
    group = hq // hkv
    block_m = _block_m(max_q_len * group)
    block_n = _decode_block_n(d)
    if balanced:
        from lmcompact.kernels.entry_balanced import launch_balanced

        launch_balanced(
            queries,
            key_pool,
            value_pool,
            block_table,
            cu_seqlens_q,
            seq_lens,
            lengths,
            out,
            scale=scale,
            num_reqs=num_reqs,
            max_q_len=max_q_len,
            num_splits=num_splits,
            block_m=block_m,
            block_n=block_n,
            precision=_dot_precision(queries.dtype),
            num_stages=decode_num_stages(d),
        )
        return
    lse = torch.empty(total_q, hq, dtype=torch.float32, device=queries.device)
    launch_split_attention(
        (num_reqs * hkv, triton.cdiv(max_q_len * group, block_m), num_splits),
        queries,
        key_pool,
        value_pool,
        None,
        None,
        block_table,
        cu_seqlens_q,
        PagedLengths(lengths.kept, lengths.tail_start, seq_lens, lengths.cells, lengths.base),
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
        entries=lengths.entries,
    )


def entry_attention_reference(
    queries: torch.Tensor,
    key_pool: torch.Tensor,
    value_pool: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    lengths: EntryLengths,
    out: torch.Tensor,
    *,
    scale: float,
    num_reqs: int,
) -> None:
    """:func:`attend_entries` in torch (host reads allowed): the per-head rows are picked on
    the host and attended by :func:`lmcompact.kernels.reference_paged.paged_attention_reference`."""
    firsts = block_table[:num_reqs, 0].long()
    entry = lengths.entries[firsts].long().cpu()
    starts = cu_seqlens_q.cpu().tolist()
    for b in range(num_reqs):
        e = int(entry[b])
        lo, hi = starts[b], starts[b + 1]
        if e < 0 or hi == lo:
            continue
        one = PagedLengths(
            lengths.kept[e : e + 1].long(),
            lengths.tail_start[e : e + 1].long(),
            seq_lens[b : b + 1].long(),
            lengths.cells[e : e + 1].long(),
            lengths.base[e : e + 1].long(),
        )
        rows, _ = paged_attention_reference(
            queries[lo:hi],
            key_pool,
            value_pool,
            block_table[b : b + 1],
            torch.tensor([0, hi - lo], device=queries.device),
            one,
            scale=scale,
        )
        out[lo:hi] = rows.to(out.dtype)
