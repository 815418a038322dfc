"""Turn a request's copied KV pages and window queries into compacted store chunks.

Engine-free (torch + lmcompact only), so the worker can run it on a background thread and
unit tests can run it without vLLM. One save job covers chunks ``first_chunk ..`` of a
prompt; the observation window is the prompt's last queries, scored against every key of
the span in O(W x chunk) memory (:func:`~lmcompact.attention.scores.window_scores`)::

    prompt     |<- loaded from store ->|<- chunk f ->|<- chunk f+1 ->|<- tail ->|
    pages                              [.............................. ........]
    window                                                          [ q q q q ]
    each chunk: policy.plan(keys, values, window mass) -> kept rows (layer, head)-major
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from connectors.kv_layout import PageLayout
from lmcompact.attention.scores import window_scores
from lmcompact.kernels import dispatch as kernels
from lmcompact.plan import KeepPlan
from lmcompact.policies import CompactionInputs, CompactionPolicy, LayerObservation, Need
from lmcompact.store import ChunkKey, CompactedChunk

logger = logging.getLogger(__name__)


class EngineShape(Protocol):
    """The engine facts a stored chunk must match (``vllm_shim.EngineFacts`` has them)."""

    @property
    def num_layers(self) -> int: ...
    @property
    def num_kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def dtype(self) -> torch.dtype: ...


SCORE_NEEDS = Need.WINDOW_SCORES | Need.WINDOW_ATTENTION


@dataclass
class SaveJob:
    """Everything needed to compact and store part of one prompt (copies, not views).

    Attributes:
        req_id: vLLM request id (for logs).
        keys: store keys of the chunks to save, in order.
        start: first token of the span (``first_chunk * chunk_size``).
        num_tokens: tokens of the span present in ``pages`` (chunks plus the unsaved tail).
        pages: per layer ``(n_blocks, H, block_size, 2 * D)`` page copies from ``start``.
        queries: per layer ``(W, Hq, D)`` post-RoPE window queries, or None.
        query_positions: ``(W,)`` absolute positions of the window queries, or None.
        scale: attention softmax scale of the model.
    """

    req_id: str
    keys: list[ChunkKey]
    start: int
    num_tokens: int
    pages: list[torch.Tensor]
    queries: list[torch.Tensor] | None
    query_positions: torch.Tensor | None
    scale: float


def uniform_keep(positions: torch.Tensor, count: int, length: int) -> torch.Tensor:
    """Make one head's kept positions exactly ``count`` long (sorted, unique).

    A head that kept fewer gets the most recent unkept tokens; one that kept more keeps
    its first ``count // 2`` and last ``count - count // 2`` choices.
    """
    n = positions.numel()
    if n == count:
        return positions
    if n > count:
        head = count // 2
        return torch.cat([positions[:head], positions[n - (count - head) :]])
    mask = torch.ones(length, dtype=torch.bool)
    mask[positions] = False
    extra = torch.nonzero(mask).flatten()[-(count - n) :]
    return torch.sort(torch.cat([positions, extra])).values


def observe_layer(
    keys: torch.Tensor,
    values: torch.Tensor,
    queries: torch.Tensor | None,
    query_positions: torch.Tensor | None,
    start: int,
    needs: Need,
    scale: float,
    kernel_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Window mass ``(H, T)`` and rows ``(H, W, T)`` of one layer, as far as ``needs`` asks.

    Keys on CUDA and no per-query rows asked: the Triton kernel
    (:func:`lmcompact.kernels.dispatch.window_scores`) in ``kernel_dtype`` (the cache dtype,
    so the cast is exact; default the keys' dtype). Otherwise the torch reference, in float32.
    """
    if not needs & SCORE_NEEDS or queries is None or queries.shape[0] == 0:
        return None, None
    assert query_positions is not None
    q = queries.to(keys.device).permute(1, 0, 2).unsqueeze(0)  # (1, Hq, W, D)
    positions = query_positions.to(keys.device) - start
    if not needs & Need.WINDOW_ATTENTION and kernels.use_kernels(keys.device):
        dtype = kernel_dtype or keys.dtype
        mass = kernels.window_scores(
            q.to(dtype).contiguous(),
            keys.unsqueeze(0).to(dtype),
            query_positions=positions,
            scale=scale,
        )
        return mass[0], None
    mass, rows = window_scores(
        q,
        keys.unsqueeze(0),
        query_positions=positions,
        scale=scale,
        chunk_size=1024,
        return_attention=bool(needs & Need.WINDOW_ATTENTION),
    )
    return mass[0], None if rows is None else rows[0]


def compact_job(
    job: SaveJob,
    layout: PageLayout,
    policy: CompactionPolicy,
    chunk_size: int,
    kept_per_chunk: int,
    store_dtype: torch.dtype | None = None,
    recent_layers: frozenset[int] = frozenset(),
) -> list[tuple[ChunkKey, CompactedChunk]]:
    """Compact every chunk of ``job``: ``(key, chunk)`` pairs ready for the store.

    Args:
        job: the copied pages and window queries.
        layout: page layout of ``job.pages``.
        policy: the compaction policy.
        chunk_size: tokens per chunk (C).
        kept_per_chunk: tokens every (layer, head) keeps of a chunk (K, block aligned).
        store_dtype: dtype of stored K/V; None keeps the cache dtype.
        recent_layers: sliding-window layers: whatever the policy chose, they keep each
            chunk's last K tokens (:meth:`lmcompact.plan.KeepPlan.with_recent`), so a
            loaded prefix's last chunk sits at logical distances in their window.
    """
    if kept_per_chunk > chunk_size or kept_per_chunk < 1:
        raise ValueError(f"kept_per_chunk must be in [1, {chunk_size}], got {kept_per_chunk}")
    n_chunks = len(job.keys)
    if job.num_tokens < n_chunks * chunk_size:
        raise ValueError(f"job has {job.num_tokens} tokens, {n_chunks} chunks need more")
    per_layer: list[tuple[torch.Tensor, torch.Tensor]] = []
    observations: list[tuple[torch.Tensor | None, torch.Tensor | None]] = []
    for index, pages in enumerate(job.pages):
        keys, values = layout.pages_to_tokens(pages)
        keys, values = keys[:, : job.num_tokens], values[:, : job.num_tokens]
        per_layer.append((keys, values))
        queries = None if job.queries is None else job.queries[index]
        observations.append(
            observe_layer(
                keys, values, queries, job.query_positions, job.start, policy.needs, job.scale
            )
        )
    out: list[tuple[ChunkKey, CompactedChunk]] = []
    for c, key in enumerate(job.keys):
        lo, hi = c * chunk_size, (c + 1) * chunk_size
        layers = [
            LayerObservation(
                keys=k[:, lo:hi],
                values=v[:, lo:hi],
                window_scores=None if mass is None else mass[:, lo:hi],
                window_attention=None if rows is None else rows[:, :, lo:hi],
            )
            for (k, v), (mass, rows) in zip(per_layer, observations, strict=True)
        ]
        inputs = CompactionInputs(
            chunk_size,
            per_layer[0][0].shape[0],
            layers,
            budget_tokens=kept_per_chunk,
        )
        plan = policy.plan(inputs) if kept_per_chunk < chunk_size else None
        if plan is not None:
            plan = plan.with_recent(recent_layers, kept_per_chunk)
        out.append((key, build_chunk(per_layer, lo, chunk_size, plan, kept_per_chunk, store_dtype)))
    return out


def build_chunk(
    per_layer: Sequence[tuple[torch.Tensor, torch.Tensor]],
    lo: int,
    chunk_size: int,
    plan: KeepPlan | None,
    kept: int,
    store_dtype: torch.dtype | None,
) -> CompactedChunk:
    """Gather kept rows of tokens ``[lo, lo + chunk_size)`` into a :class:`CompactedChunk`.

    Rows are (layer, head)-major, kept tokens in original order; ``plan`` None keeps all.
    """
    keys_out: list[torch.Tensor] = []
    values_out: list[torch.Tensor] = []
    positions_out: list[torch.Tensor] = []
    for layer, (k, v) in enumerate(per_layer):
        for head in range(k.shape[0]):
            if plan is None:
                idx = torch.arange(chunk_size)
            else:
                idx = uniform_keep(plan.kept[layer][head], kept, chunk_size)
            keys_out.append(k[head, lo + idx])
            values_out.append(v[head, lo + idx])
            positions_out.append(idx.to(torch.int32))
    keys = torch.cat(keys_out)
    values = torch.cat(values_out)
    if store_dtype is not None:
        keys, values = keys.to(store_dtype), values.to(store_dtype)
    counts = torch.full((len(per_layer), per_layer[0][0].shape[0]), kept, dtype=torch.int32)
    return CompactedChunk(
        keys=keys.contiguous(),
        values=values.contiguous(),
        kept_counts=counts,
        positions=torch.cat(positions_out),
        num_tokens=chunk_size,
    )


def chunk_problem(
    chunk: CompactedChunk, facts: EngineShape, chunk_size: int, kept: int
) -> str | None:
    """Why a stored ``chunk`` cannot be loaded into this engine, or None.

    The codec already refused damaged bytes and foreign formats; this checks that a valid
    chunk fits: layers, heads, head size, dtype, chunk length and kept count.
    """
    expected = (
        facts.num_layers,
        facts.num_kv_heads,
        facts.head_dim,
        facts.head_dim,
        facts.dtype,
        chunk_size,
        kept,
    )
    got = (
        chunk.num_layers,
        chunk.num_kv_heads,
        chunk.keys.shape[1],
        chunk.values.shape[1],
        chunk.dtype,
        chunk.num_tokens,
        chunk.uniform_count(),
    )
    if got != expected:
        return f"shaped {got}, not the expected {expected} (layers, heads, dims, dtype, C, K)"
    pos = chunk.positions
    if pos.numel() and (int(pos.min()) < 0 or int(pos.max()) >= chunk.num_tokens):
        return "holding positions outside the chunk"
    return None


def full_nbytes(chunk: CompactedChunk, head_dim: int) -> int:
    """Bytes of K and V the chunk would hold uncompacted (every token of every head)."""
    rows = chunk.num_layers * chunk.num_kv_heads * chunk.num_tokens
    return rows * 2 * head_dim * chunk.keys.element_size()
