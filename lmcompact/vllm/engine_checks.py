"""Start-up checks of the connector options against the engine (block size, model shape).

:class:`lmcompact.vllm.config.ConnectorConfig` checks everything that needs no engine when it is
parsed; what depends on the block size or the model's shape runs here when the connector is
built: ``ValueError`` with the bad value and what is allowed.
"""

from __future__ import annotations

import dataclasses

import torch

from lmcompact.policies import CompactionInputs, CompactionPolicy, LayerObservation, Need
from lmcompact.vllm.config import BUDGET_TOLERANCE, ConnectorConfig, kept_blocks

UNSUPPORTED_NEEDS = Need.CUMULATIVE_SCORES | Need.TOKEN_CLASSES
"""Inputs the connector never captures (policies needing them are refused)."""


def honours(budget: float, blocks: int) -> bool:
    """Whether keeping whole blocks of ``blocks`` can honour ``budget`` (within tolerance)."""
    return abs(kept_blocks(budget, blocks) / blocks - budget) <= BUDGET_TOLERANCE * budget


def check_budget_geometry(budget: float, chunk_size: int, block_size: int) -> None:
    """ValueError naming the possible budgets when whole blocks cannot honour ``budget``.

    A chunk of ``chunk_size / block_size`` blocks keeps a whole number of them, so the
    kept fraction moves in steps of one block: with block 128 and chunk 256 only 0.5 and 1
    exist, and 0.25 or 0.1 would silently keep half.
    """
    blocks = chunk_size // block_size
    if honours(budget, blocks):
        return
    possible = [k / blocks for k in range(1, blocks + 1)]
    nearest = min(possible, key=lambda f: abs(f - budget))
    shown = ", ".join(f"{f:g}" for f in possible[:8]) + (", ..." if blocks > 8 else "")
    larger = next((m for m in range(blocks + 1, 64 * blocks + 1) if honours(budget, m)), None)
    hint = (
        f"; or chunk_size {larger * block_size} ({larger} blocks) keeps "
        f"{kept_blocks(budget, larger) / larger:g}"
        if larger is not None
        else ""
    )
    raise ValueError(
        f"budget {budget:g} cannot be honoured with chunk_size {chunk_size} and block size "
        f"{block_size}: a chunk of {blocks} block(s) keeps whole blocks, so the possible "
        f"budgets are {shown} (the nearest, {nearest:g}, is more than "
        f"{BUDGET_TOLERANCE:.0%} away); set budget to one of them{hint}"
    )


def validate_against_engine(
    config: ConnectorConfig,
    *,
    block_size: int,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    per_head_counts: bool = False,
) -> None:
    """Checks that need the engine: ValueError with the bad value and what is allowed.

    A compacting policy must (1) keep the same number of tokens in every (layer, head),
    because attention skips one block-aligned hole per request (unless ``per_head_counts``:
    ``release.per_head`` and ``store.per_head`` pad and mask), and (2) need only inputs
    the connector captures. vLLM's prefix caching may stay on: compacted blocks are kept
    out of its cache (:class:`lmcompact.vllm.memory.blocks.PrefixCacheGuard`).
    """
    per_head_counts = per_head_counts or config.per_head_counts
    chunk = config.store.chunk_size
    if chunk % block_size:
        allowed = ", ".join(str(block_size * k) for k in (2, 4, 8, 16))
        raise ValueError(
            f"chunk_size {chunk} must be a multiple of the engine block size "
            f"{block_size} (e.g. {allowed})"
        )
    if not config.compacts:
        return
    if config.store_compacts and config.store.enabled:
        # chunks stored whole (compact_on "load") are packed per prompt, checked there
        check_budget_geometry(float(config.budget), chunk, block_size)
    policy = config.make_policy()
    missing = policy.needs & UNSUPPORTED_NEEDS
    if missing:
        raise ValueError(
            f"policy {config.policy!r} needs {missing}, which the vLLM connector does not "
            "capture (it sees the observation window's queries and the keys/values); "
            "allowed: policies needing KEYS, WINDOW_SCORES, WINDOW_ATTENTION, WINDOW_QUERIES "
            "or CONTEXT_SCORES"
        )
    if policy.needs & (Need.WINDOW_QUERIES | Need.WINDOW_SCORES | Need.WINDOW_ATTENTION) and (
        config.window < 1
    ):
        raise ValueError(
            f"policy {config.policy!r} reads the observation window's queries; window must be "
            f">= 1 (default 32), got {config.window}"
        )
    if per_head_counts:
        return
    # the count the policy must honour per chunk, whether it runs at save or at load
    store = dataclasses.replace(config.store, compact_on="save")
    kept = dataclasses.replace(config, store=store).kept_per_chunk(block_size)
    plan = policy.plan(probe_inputs(config, policy, num_layers, num_kv_heads, head_dim, kept))
    counts = plan.kept_counts()
    if not bool((counts == kept).all()):
        raise ValueError(
            f"policy {config.policy!r} keeps different numbers of tokens per head or layer, or "
            f"not the asked number (min {int(counts.min())}, max {int(counts.max())}, asked "
            f"{kept} per chunk); the "
            "vLLM connector needs the same count everywhere (attention skips one "
            "block-aligned hole per request). Uniform policies: none, streaming_llm, snapkv, "
            "knorm, tova, random, kvzip, expected_attention; per-head policies run with "
            'the "release" option "per_head" (in place) or the "store" option "per_head"'
        )


def probe_inputs(
    config: ConnectorConfig,
    policy: CompactionPolicy,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    kept: int,
) -> CompactionInputs:
    """Synthetic inputs of the engine's shape, to check a policy's plan shape at start-up."""
    gen = torch.Generator().manual_seed(0)
    t = config.store.chunk_size
    window = max(1, min(config.window, t))
    layers = []
    for _ in range(num_layers):
        keys = torch.randn(num_kv_heads, t, head_dim, generator=gen)
        scores = torch.rand(num_kv_heads, t, generator=gen)
        attention = torch.rand(num_kv_heads, window, t, generator=gen)
        layers.append(
            LayerObservation(
                keys=keys,
                values=torch.randn_like(keys),
                window_scores=scores,
                window_attention=attention,
                context_scores=torch.rand(num_kv_heads, t, generator=gen),
                window_queries=torch.randn(num_kv_heads, window, head_dim, generator=gen),
            )
        )
    return CompactionInputs(
        t,
        num_kv_heads,
        layers,
        budget_tokens=kept,
        query_positions=torch.arange(t, t + window),
    )
