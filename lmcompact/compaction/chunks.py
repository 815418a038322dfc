"""Stored chunks of the connector: built from kept rows, checked against the engine, sized.

Engine-free (torch + lmcompact only). :func:`build_chunk` gathers the kept rows of one
chunk of a save job (:mod:`lmcompact.compaction.save_job`) into a :class:`CompactedChunk`;
:func:`chunk_problem` says why a stored chunk cannot load into this engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from lmcompact.plan import KeepPlan
from lmcompact.store import CompactedChunk
from lmcompact.store.quant import FLOAT_DTYPES, quantized_nbytes


class EngineShape(Protocol):
    """The engine facts a stored chunk must match (an engine connector's facts have them)."""

    @property
    def num_layers(self) -> int: ...
    @property
    def num_kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def page_dtype(self) -> torch.dtype:
        """dtype of the cache's elements (uint8 for fp8 caches), which stored rows keep."""
        ...


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


def fit_layer(positions: list[torch.Tensor], limit: int, length: int) -> list[torch.Tensor]:
    """One layer's per-head kept positions with at most ``limit`` in all (and >= 1 each).

    Heads are cut from the largest down to one common count, the largest that fits (a
    water level), so heads below it keep all they chose; a cut head keeps its first and last
    choices (:func:`uniform_keep`).
    """
    counts = [p.numel() for p in positions]
    if sum(counts) <= limit:
        return positions
    if limit < len(positions):
        raise ValueError(f"{len(positions)} heads cannot keep >= 1 token each in {limit}")
    level = max(
        (c for c in range(1, max(counts) + 1) if sum(min(n, c) for n in counts) <= limit),
        default=1,
    )
    return [uniform_keep(p, level, length) if p.numel() > level else p for p in positions]


def build_chunk(
    per_layer: Sequence[tuple[torch.Tensor, torch.Tensor]],
    lo: int,
    chunk_size: int,
    plan: KeepPlan | None,
    kept: int,
    store_dtype: torch.dtype | None,
    cap: int | None = None,
    layer_cap: int | None = None,
) -> CompactedChunk:
    """Gather kept rows of tokens ``[lo, lo + chunk_size)`` into a :class:`CompactedChunk`.

    Rows are (layer, head)-major, kept tokens in original order; ``plan`` None keeps all.
    Every (layer, head) keeps ``kept`` tokens (:func:`uniform_keep`), or with ``cap``
    (``store.per_head``) the plan's own count, clipped to ``cap``, a layer's heads together
    to ``layer_cap`` (:func:`fit_layer`).
    """
    heads = per_layer[0][0].shape[0]
    keys_out: list[torch.Tensor] = []
    values_out: list[torch.Tensor] = []
    positions_out: list[torch.Tensor] = []
    counts = torch.zeros(len(per_layer), heads, dtype=torch.int32)
    for layer, (k, v) in enumerate(per_layer):
        picked = [_head_keep(plan, layer, head, kept, cap, chunk_size) for head in range(heads)]
        if cap is not None and layer_cap is not None and plan is not None:
            picked = fit_layer(picked, layer_cap, chunk_size)
        counts[layer] = torch.tensor([p.numel() for p in picked], dtype=torch.int32)
        # one gather per layer for all heads over (H, widest) indices; advanced indexing
        # per head (``k[head, lo + idx]``) took ~8 ms a call on the CPU
        idx = torch.nn.utils.rnn.pad_sequence(picked, batch_first=True)
        rows = None
        if bool((counts[layer] != idx.shape[1]).any()):  # ragged: drop each head's padding
            rows = torch.arange(idx.shape[1])[None, :] < counts[layer, :, None]
        keys_out.append(_gather_rows(k[:, lo : lo + chunk_size], idx, rows))
        values_out.append(_gather_rows(v[:, lo : lo + chunk_size], idx, rows))
        positions_out.append(torch.cat(picked).to(torch.int32))
    keys = torch.cat(keys_out)
    values = torch.cat(values_out)
    if store_dtype is not None:
        keys, values = keys.to(store_dtype), values.to(store_dtype)
    return CompactedChunk(
        keys=keys.contiguous(),
        values=values.contiguous(),
        kept_counts=counts,
        positions=torch.cat(positions_out).to(keys.device),
        num_tokens=chunk_size,
    )


def _head_keep(
    plan: KeepPlan | None, layer: int, head: int, kept: int, cap: int | None, chunk_size: int
) -> torch.Tensor:
    """Sorted int64 positions one (layer, head) stores: all (no plan), exactly ``kept``,
    or with ``cap`` the plan's own (at most ``cap``)."""
    if plan is None:
        return torch.arange(chunk_size)
    chosen = plan.kept[layer][head].to(torch.int64)
    if cap is None:
        return uniform_keep(chosen, kept, chunk_size)
    return uniform_keep(chosen, cap, chunk_size) if chosen.numel() > cap else chosen


def _gather_rows(
    rows: torch.Tensor, index: torch.Tensor, valid: torch.Tensor | None = None
) -> torch.Tensor:
    """``(H * K, D)``: rows ``index[h]`` of ``rows[h]`` (``rows`` ``(H, C, D)``, ``index``
    ``(H, K)``), head-major; with ``valid`` ``(H, K)`` only the True entries."""
    index = index.to(rows.device)
    picked = torch.gather(rows, 1, index.unsqueeze(-1).expand(-1, -1, rows.shape[-1]))
    if valid is not None:
        return picked[valid.to(rows.device)]
    return picked.reshape(-1, rows.shape[-1])


def chunk_problem(
    chunk: CompactedChunk,
    facts: EngineShape,
    chunk_size: int,
    kept: int,
    cap: int | None = None,
    layer_cap: int | None = None,
) -> str | None:
    """Why a stored ``chunk`` cannot be loaded into this engine, or None.

    The codec already refused damaged bytes and foreign formats; this checks that a valid
    chunk fits: layers, heads, head size, dtype, chunk length and kept count (``kept`` for
    every (layer, head); with ``cap``, per-head counts, each at most ``cap``, each layer's
    at most ``layer_cap`` in all).
    """
    if cap is not None:
        counts = chunk.kept_counts
        if counts.numel() and (int(counts.min()) < 0 or int(counts.max()) > cap):
            low, high = int(counts.min()), int(counts.max())
            return f"holding per-head counts in [{low}, {high}], not <= {cap}"
        widest = int(counts.sum(dim=1).max()) if counts.numel() else 0
        if layer_cap is not None and widest > layer_cap:
            return f"holding {widest} rows in one layer, more than its {layer_cap} cells"
    # one count K for every (layer, head), unless per-head counts are allowed
    expected = (
        facts.num_layers,
        facts.num_kv_heads,
        facts.head_dim,
        facts.head_dim,
        facts.page_dtype,
        chunk_size,
        None if cap is not None else kept,
    )
    got = (
        chunk.num_layers,
        chunk.num_kv_heads,
        chunk.keys.shape[1],
        chunk.values.shape[1],
        chunk.dtype,
        chunk.num_tokens,
        None if cap is not None else chunk.uniform_count(),
    )
    if got != expected:
        return f"shaped {got}, not the expected {expected} (layers, heads, dims, dtype, C, K)"
    pos = chunk.positions
    if pos.numel() and (int(pos.min()) < 0 or int(pos.max()) >= chunk.num_tokens):
        return "holding positions outside the chunk"
    return None


BF16_BYTES = 2
"""Bytes of one bfloat16 value: the reference dtype of stored-byte fractions (serving
engines run bf16; a float32 engine's chunks would flatter a quantized store 2x)."""


def full_nbytes(chunk: CompactedChunk, head_dim: int, element_size: int | None = None) -> int:
    """Bytes of K and V the chunk would hold uncompacted (every token of every head), in
    the chunk's dtype or at ``element_size`` bytes a value."""
    rows = chunk.num_layers * chunk.num_kv_heads * chunk.num_tokens
    return rows * 2 * head_dim * (element_size or chunk.keys.element_size())


def stored_nbytes(chunk: CompactedChunk, quantize: str | None) -> int:
    """Payload bytes the store holds for ``chunk``: its quantized rows, scales and
    positions under ``quantize`` (floating chunks only; others are stored as they are),
    else its packed payload."""
    if quantize is None or chunk.dtype not in FLOAT_DTYPES:
        return chunk.payload_nbytes
    return quantized_nbytes(
        chunk.total_kept, chunk.keys.shape[1], chunk.values.shape[1], chunk.num_tokens
    )


LOAD_GROUP_BYTES = 256 << 20
"""Largest run of loaded chunks (or, with per-head counts, of per-head layer rows) gathered
on the cache's device before it is written."""


def runs_of_bytes(
    chunks: list[CompactedChunk], limit: int
) -> list[tuple[int, list[CompactedChunk]]]:
    """``(index of the run's first chunk, run)``: consecutive chunks whose K/V bytes stay
    within ``limit`` (a single larger chunk is a run of its own)."""
    runs: list[tuple[int, list[CompactedChunk]]] = []
    size = 0
    for index, chunk in enumerate(chunks):
        nbytes = chunk.keys.nbytes + chunk.values.nbytes
        if not runs or size + nbytes > limit:
            runs.append((index, []))
            size = 0
        runs[-1][1].append(chunk)
        size += nbytes
    return runs
