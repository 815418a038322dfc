"""Pick the Triton kernel on CUDA and the torch reference elsewhere.

One switch forces the references everywhere: the environment variable
``LMCOMPACT_FORCE_REFERENCE=1``, or, scoped, ``with force_reference(): ...``
(the context manager wins over the variable)::

    tensors on CUDA, Triton importable, not forced  ->  lmcompact.kernels.<kernel>
    anything else                                   ->  torch reference

Triton modules are imported only when a kernel is chosen, so this module
works where Triton is missing.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar

import torch

from lmcompact.attention import scores as scores_reference
from lmcompact.attention.pooling import pool_scores
from lmcompact.kernels.moves import DefragPlan, SlotMoves, compaction_moves, plan_defragment
from lmcompact.kernels.reference_paged import (
    move_slots_reference,
    paged_attention_reference,
)
from lmcompact.layout.paged import PagedLengths

FORCE_REFERENCE_ENV = "LMCOMPACT_FORCE_REFERENCE"
_FORCED: ContextVar[bool | None] = ContextVar("lmcompact_force_reference", default=None)


@contextmanager
def force_reference(enabled: bool = True) -> Iterator[None]:
    """Use (or, with ``enabled=False``, stop forcing) the torch references in this scope."""
    token = _FORCED.set(enabled)
    try:
        yield
    finally:
        _FORCED.reset(token)


def reference_forced() -> bool:
    """True when the context manager or ``LMCOMPACT_FORCE_REFERENCE`` forces references."""
    forced = _FORCED.get()
    if forced is not None:
        return forced
    return os.environ.get(FORCE_REFERENCE_ENV, "").strip().lower() in ("1", "true", "yes", "on")


@functools.cache
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def use_kernels(device: torch.device) -> bool:
    """Whether tensors on ``device`` go to the Triton kernels."""
    return device.type == "cuda" and not reference_forced() and triton_available()


def window_scores(
    queries: torch.Tensor,
    keys: torch.Tensor,
    *,
    query_positions: torch.Tensor | None = None,
    scale: float | None = None,
    pool_size: int = 1,
    pool: str = "maxpool",
) -> torch.Tensor:
    """``(B, Hkv, T)`` float32 window-attention mass per key, optionally SnapKV-pooled.

    Args:
        queries: ``(B, Hq, W, D)`` post-RoPE window queries.
        keys: ``(B, Hkv, T, D)`` post-RoPE keys.
        query_positions: ``(W,)`` (default: the last W positions).
        scale: Softmax scale (default ``1 / sqrt(D)``).
        pool_size: Odd pooling window along T (1 = none).
        pool: ``"maxpool"`` or ``"avgpool"`` (:func:`lmcompact.attention.pooling.pool_scores`,
            the pooling the policies use).
    """
    if use_kernels(queries.device):
        from lmcompact.kernels import window_scores as kernel

        mass = kernel.window_scores(queries, keys, query_positions=query_positions, scale=scale)
    else:
        mass, _ = scores_reference.window_scores(
            queries, keys, query_positions=query_positions, scale=scale
        )
    return pool_scores(mass, pool_size, pool)


def _check_query_runs(cu_seqlens_q: torch.Tensor, lengths: PagedLengths) -> None:
    q_len = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).cpu()
    tail = (lengths.seq_len - lengths.tail_start).cpu()
    if bool((q_len < 0).any()) or bool((q_len > tail).any()):
        raise ValueError(
            "each request's queries must be its last tail tokens: need 0 <= q_len <= "
            f"seq_len - tail_start; q_len {q_len.tolist()}, tail {tail.tolist()}"
        )


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
    validate: bool = True,
    max_q_len: int | None = None,
    max_visible: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention over a compacted paged pool with per-head lengths (decode or prefill).

    Shapes as in :func:`lmcompact.kernels.reference_paged.paged_attention_reference`.
    ``validate`` checks the lengths on the host (a device sync); turn it off in a
    hot loop once the caller guarantees them. ``max_q_len`` (longest query run)
    and ``max_visible`` (most keys any head sees, an upper bound will do) are
    host ints the Triton kernel otherwise reads back from the device (a sync
    each); the reference ignores them.
    """
    if validate:
        lengths.validate(
            lengths.num_kv_heads, block_table.shape[1] * key_pool.shape[1], key_pool.shape[1]
        )
        _check_query_runs(cu_seqlens_q, lengths)
    args = (queries, key_pool, value_pool, block_table, cu_seqlens_q, lengths)
    if use_kernels(queries.device):
        from lmcompact.kernels import paged_attention as kernel

        return kernel.paged_attention(
            *args,
            scale=scale,
            return_key_mass=return_key_mass,
            max_q_len=max_q_len,
            max_visible=max_visible,
        )
    return paged_attention_reference(*args, scale=scale, return_key_mass=return_key_mass)


def move_slots(
    src_keys: torch.Tensor,
    src_values: torch.Tensor,
    src_table: torch.Tensor,
    dst_keys: torch.Tensor,
    dst_values: torch.Tensor,
    dst_table: torch.Tensor,
    moves: SlotMoves,
) -> None:
    """Copy tokens between (or within) paged pools; overlapping moves are safe."""
    args = (src_keys, src_values, src_table, dst_keys, dst_values, dst_table, moves)
    if use_kernels(src_keys.device):
        from lmcompact.kernels import compaction_copy as kernel

        kernel.move_slots(*args)
    else:
        move_slots_reference(*args)


def compact_heads(
    key_pool: torch.Tensor,
    value_pool: torch.Tensor,
    block_table: torch.Tensor,
    keep: Sequence[torch.Tensor],
    *,
    dst_keys: torch.Tensor | None = None,
    dst_values: torch.Tensor | None = None,
    dst_table: torch.Tensor | None = None,
) -> torch.Tensor:
    """Pack each (request, head)'s kept slots into slots ``[0, n)``, in the given order.

    Args:
        key_pool, value_pool: ``(num_blocks, block_size, Hkv, D)`` source views.
        block_table: ``(B, max_blocks)`` source block ids.
        keep: ``B * Hkv`` int tensors (segment ``b * Hkv + h``) of slots to keep.
        dst_keys, dst_values, dst_table: Destination pool and table (default: in
            place, the request's own blocks).

    Returns:
        ``(B, Hkv)`` int64 kept counts: the new ``PagedLengths.kept``.
    """
    hkv = key_pool.shape[2]
    moves = compaction_moves(keep, hkv)
    if moves.src_slots.device != key_pool.device:
        moves = _moves_to(moves, key_pool.device)
    move_slots(
        key_pool,
        value_pool,
        block_table,
        key_pool if dst_keys is None else dst_keys,
        value_pool if dst_values is None else dst_values,
        block_table if dst_table is None else dst_table,
        moves,
    )
    return (moves.cu[1:] - moves.cu[:-1]).view(-1, hkv)


def defragment(
    key_pool: torch.Tensor,
    value_pool: torch.Tensor,
    block_table: torch.Tensor,
    lengths: PagedLengths,
) -> DefragPlan:
    """Move every request's live tokens into the lowest blocks of the pool.

    Returns the plan that was applied: new block table, new lengths, and the
    blocks freed (see :func:`lmcompact.kernels.moves.plan_defragment`).
    """
    plan = plan_defragment(block_table, lengths, key_pool.shape[1])
    new_table = plan.block_table.to(block_table.dtype)
    width = max(block_table.shape[1], new_table.shape[1])
    # one table holding both: a request's old row and its new row
    old = torch.zeros(
        block_table.shape[0], width, dtype=block_table.dtype, device=block_table.device
    )
    new = torch.zeros_like(old)
    old[:, : block_table.shape[1]] = block_table
    new[:, : new_table.shape[1]] = new_table
    move_slots(key_pool, value_pool, old, key_pool, value_pool, new, plan.moves)
    return plan


def _moves_to(moves: SlotMoves, device: torch.device) -> SlotMoves:
    return SlotMoves(
        src_slots=moves.src_slots.to(device),
        cu=moves.cu.to(device),
        request=moves.request.to(device),
        head=moves.head.to(device),
        dst_start=moves.dst_start.to(device),
        max_count=moves.max_count,
    )
